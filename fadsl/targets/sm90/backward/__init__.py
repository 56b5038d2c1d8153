"""sm_90a's backward pass (docs/backward.md): the SMEM plan, the kernels' template context
and the host side of their launches."""

from ...launch import BackwardLaunch
from .emit import TEMPLATE, context
from .host import SUFFIXES, dynamic_smem, run, run_varlen, threads

BACKWARD_LAUNCH = BackwardLaunch(
    template=TEMPLATE,
    context=context,
    suffixes=SUFFIXES,
    smem=dynamic_smem,
    threads=threads,
    run=run,
    run_varlen=run_varlen,
)

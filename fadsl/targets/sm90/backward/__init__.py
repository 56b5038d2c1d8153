"""sm_90a's backward pass (docs/backward.md): the SMEM plan, the kernels' template context
and the host side of their launches."""

from ...launch import BackwardLaunch
from ..learn import learn_backward_lines
from .emit import TEMPLATE, context
from .host import SUFFIXES, classes_only, dynamic_smem, run, run_varlen, suffixes, threads
from .launch_plan import plan

BACKWARD_LAUNCH = BackwardLaunch(
    template=TEMPLATE,
    context=context,
    suffixes=SUFFIXES,
    smem=dynamic_smem,
    threads=threads,
    run=run,
    run_varlen=run_varlen,
    suffixes_of=suffixes,  # a learnable variant's `_learn` (host.LEARN_SUFFIX)
    learn_lines=learn_backward_lines,  # B_r 64 for a B_r 80 block (learn.py says why)
    classes_only=classes_only,  # a keep's tile classes made ahead (host/keep_classes.py)
    plan=plan,  # a padded call's launch plan (launch_plan.py)
)

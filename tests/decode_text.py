"""The shipped decode spec (examples/serving/fa3_decode_paged.fa) and its text at one CTA an SM,
for tests that edit it past what half an SM holds or that compare the two."""

from __future__ import annotations

import re

from conftest import ROOT

DECODE = (ROOT / "examples" / "serving" / "fa3_decode_paged.fa").read_text()

# the example's registers and ctas_per_sm lines, with their comment's continuation lines
_TWO_CTA_LINES = re.compile(
    r"^(\s*)registers\s+producer = 40, consumers = 216.*\n\s*ctas_per_sm 2.*\n(?:\s+#.*\n)*", re.M
)


def one_cta(text: str) -> str:
    """``text`` (the decode example or an edit of it) at one CTA an SM: the split it had
    before `ctas_per_sm 2` shipped (56 / 256), no ctas_per_sm line."""
    one, count = _TWO_CTA_LINES.subn(
        r"\1registers  producer = 56, consumers = 256\n", text, count=1
    )
    assert count == 1, "the decode example's two-CTA lines moved"
    return one

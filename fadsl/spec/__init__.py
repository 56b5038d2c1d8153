"""A spec as written: its syntax tree (syntax: Lark -> located nodes) and the checks every
part of the front end and every target's validation share (checks: the diagnostics sink,
the values read so far, the messages' helpers). Below the targets and the front end, so
that both can use them (docs: README, "Layout")."""

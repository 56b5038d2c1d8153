"""The front end: a spec's text to a Lowered IR, or located errors.

syntax (the Lark grammar's parse tree -> AST), checks (the diagnostics of one spec, all at
once), settings / paths / order (each part of a spec, checked), lower (the AST -> IR, asking
the spec's target for its own checks).
"""

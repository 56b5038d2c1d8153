"""The async model: warp-specialised pipelines (agents, mbarriers, named barriers, TMA,
wgmma and bulk groups, proxies, clusters) and the proof that a sync plan orders every hazard
and cannot hang.

model (the program a target's verify builds), run (the one execution), order (its
happens-before), phases (no wait can pass a phase early), hazards (every conflicting pair
ordered), cluster (the cluster barrier), exit (no CTA exits while a peer can reach it), and
prove, which runs them in turn.
"""

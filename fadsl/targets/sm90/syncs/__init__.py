"""sm_90a's sync pass, one module per mechanism: mbarrier (TMA rings and their parity),
wgmma (commit groups and waits), pingpong (the consumers' named-barrier turns), store (O's
SMEM and its TMA store), cluster (peer arrivals and cluster barriers), over a shared state;
insert runs them in order."""

"""sm_90a's host side: the launch (params, tile grid, split tail, clusters), the TMA
descriptors and the split tail's workspace."""

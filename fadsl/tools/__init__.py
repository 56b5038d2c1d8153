"""Tools beside the compiler: bench (against PyTorch's backends and FlashAttention-4),
clocks (NVML sampling), sass (disassembly), tiletrace (where a tile's time goes), report
(check and explain)."""

"""Building: NVRTC (or nvcc) to cubins, the content-addressed cache, ptxas's resource
report and occupancy (resources), the spill check, the cubin's ELF notes."""

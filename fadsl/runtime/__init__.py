"""The runtime: a compiled spec as a PyTorch operator (attention), its torch custom ops
(custom_op), the arguments' checks (arguments) and the CUDA driver calls (driver)."""

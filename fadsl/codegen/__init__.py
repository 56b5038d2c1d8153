"""Code generation: a Kernel and a dtype through the target's jinja2 template to CUDA
source (render), and the headers the sources include."""

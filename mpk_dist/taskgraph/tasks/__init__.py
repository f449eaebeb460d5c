"""Task kinds: one module per kind (tiling, arguments, CPU reference)."""

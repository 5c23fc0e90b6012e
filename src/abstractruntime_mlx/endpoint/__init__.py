"""The seed's server path (``abstractcore.endpoint``) under this package's name: a thin alias
of ``abstractruntime_mlx.server``."""

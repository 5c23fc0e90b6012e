"""The seed's module paths under this package's name (``abstractcore.providers.*`` →
``abstractruntime_mlx.providers.*``): thin aliases of the modules that own the code."""

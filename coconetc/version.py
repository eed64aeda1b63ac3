"""The compiler's version: a leaf module, so that every layer (the renderers' banners, the
toolchain's cache key) reads it without importing the package top."""

__version__ = "0.1.0"

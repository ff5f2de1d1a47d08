"""ktlite's version, in a module of its own so that layers below the package face can read it."""

__version__ = "0.1.0"

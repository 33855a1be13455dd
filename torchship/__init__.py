"""torchship: train -> export -> serve -> bench, with every hand-over checked."""

__version__ = "0.1.0"

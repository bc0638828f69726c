"""The plugin version, stamped into every config section and model card the plugin writes."""

__version__ = "0.2.0"

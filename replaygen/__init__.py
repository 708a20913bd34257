"""replaygen: spec-driven ReplaySSM decode kernels for recurrent layers."""

__version__ = "0.1.0"

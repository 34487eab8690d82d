"""Experiments that use the project's command-line tools as they are, one question a file (aqn_grid.py: does quantization noise help exploration?)."""

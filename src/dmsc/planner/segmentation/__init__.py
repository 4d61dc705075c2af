"""Segmentation of a model into micro-models: by layers, by blocks, by business (task heads).

:mod:`.cuts` holds the pure algorithms (cost arrays and block graphs in, cut points out);
:mod:`.from_specs` costs a model on a cluster with the cost model and calls them.
"""

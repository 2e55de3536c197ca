"""Graphs for examples, tests and benchmarks: the Planetoid citation graphs, R-MAT and molecule-like generators."""

from jinsum.datasets._molecules import molecules as molecules
from jinsum.datasets._planetoid import Planetoid as Planetoid
from jinsum.datasets._planetoid import load_planetoid as load_planetoid
from jinsum.datasets._rmat import rmat as rmat

__all__ = ["Planetoid", "load_planetoid", "molecules", "rmat"]

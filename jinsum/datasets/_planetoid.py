"""The Planetoid citation graphs (Cora, Citeseer, PubMed), shipped with the package."""

from __future__ import annotations

import dataclasses
from importlib import resources

import numpy as np
import scipy.sparse as sp

_NAMES = ("cora", "citeseer", "pubmed")


@dataclasses.dataclass(frozen=True)
class Planetoid:
    """One Planetoid graph (Yang, Cohen & Salakhutdinov, ICML 2016), as plain NumPy/SciPy data.

    Attributes:
      name: ``"cora"``, ``"citeseer"`` or ``"pubmed"``.
      edge_index: int32 ``(2, E)``, both directions of every undirected edge, no self loops, sorted by
        (source, destination); row 0 is the source (the PyG convention, as ``GroupCOO.from_edge_index`` reads it).
      num_nodes: ``N``.
      x: ``scipy.sparse.csr_matrix`` float32 ``(N, F)`` bag-of-words features, or None (PubMed ships the graph
        only).
      y: int32 ``(N,)`` class labels, -1 where a node has none (Citeseer's 15 isolated test nodes); or None.
      train_idx, val_idx, test_idx: int32 node indices of the standard semi-supervised split of Kipf & Welling
        (20 training nodes per class, 500 validation, 1000 test); or None.
      num_classes: the number of classes, or None without labels.
    """

    name: str
    edge_index: np.ndarray
    num_nodes: int
    x: sp.csr_matrix | None
    y: np.ndarray | None
    train_idx: np.ndarray | None
    val_idx: np.ndarray | None
    test_idx: np.ndarray | None
    num_classes: int | None


def load_planetoid(name: str) -> Planetoid:
    """Loads a Planetoid graph from the package data (no download).

    Args:
      name: ``"cora"``, ``"citeseer"`` or ``"pubmed"`` (case-insensitive).

    Returns:
      A :class:`Planetoid`. Cora: 2,708 nodes, 10,556 directed edges, 1,433 features, 7 classes; Citeseer:
      3,327 / 9,104 / 3,703 / 6; PubMed: 19,717 nodes and 88,648 edges, without features or labels.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _NAMES:
        raise ValueError(f"load_planetoid: unknown dataset {name!r}; expected one of {', '.join(_NAMES)}")
    # importlib.resources reads the file wherever the package is installed (also from a zip or wheel).
    with resources.files(__package__).joinpath("data", f"{key}.npz").open("rb") as f, np.load(f) as npz:
        arrays = {k: npz[k] for k in npz.files}
    x = y = train_idx = val_idx = test_idx = num_classes = None
    if "y" in arrays:
        x = sp.csr_matrix((arrays["x_data"], arrays["x_indices"], arrays["x_indptr"]), shape=tuple(arrays["x_shape"]))
        y, train_idx, val_idx, test_idx = (arrays[k] for k in ("y", "train_idx", "val_idx", "test_idx"))
        num_classes = int(y.max()) + 1
    return Planetoid(
        name=key,
        edge_index=arrays["edge_index"],
        num_nodes=int(arrays["num_nodes"]),
        x=x,
        y=y,
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        num_classes=num_classes,
    )

"""Typed inputs of dmsc: cluster, model and job specs, validated where they enter."""

from dmsc.spec.cluster import (
    ClusterSpec,
    DatacenterSpec,
    DCNetworkSpec,
    DeviceTypeSpec,
    InterDCLinkSpec,
    LinkSpec,
    NodeGroupSpec,
    NodeTypeSpec,
)
from dmsc.spec.errors import SpecError
from dmsc.spec.job import JobSpec
from dmsc.spec.loader import load_spec, read_document, validate_document
from dmsc.spec.model import (
    BlockGraphSpec,
    BlockSpec,
    LayerListSpec,
    LayerSpec,
    ModelSpec,
    TransformerSpec,
)
from dmsc.spec.presets import MODEL_PRESETS, parse_any_model, parse_model, resolve_model
from dmsc.spec.sync import Compression, SyncSpec, parse_compress, parse_sync

__all__ = [
    "MODEL_PRESETS",
    "BlockGraphSpec",
    "BlockSpec",
    "ClusterSpec",
    "Compression",
    "DCNetworkSpec",
    "DatacenterSpec",
    "DeviceTypeSpec",
    "InterDCLinkSpec",
    "JobSpec",
    "LayerListSpec",
    "LayerSpec",
    "LinkSpec",
    "ModelSpec",
    "NodeGroupSpec",
    "NodeTypeSpec",
    "SpecError",
    "SyncSpec",
    "TransformerSpec",
    "load_spec",
    "parse_any_model",
    "parse_compress",
    "parse_model",
    "parse_sync",
    "read_document",
    "resolve_model",
    "validate_document",
]

"""The federated core: types, IR, intrinsics, tracing, serialization."""

"""The dspark gRPC server (`python -m serve`), its client (`python -m serve.client`) and load
benchmark (`python -m serve.bench`); see serve/README.md."""

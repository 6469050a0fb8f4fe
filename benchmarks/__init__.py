"""Side-by-side measurements of jaxlod, each a module run from the repository
root: ``python -m benchmarks.NAME [--json PATH]`` (benchmarks/README.md).
`benchmarks.timing` is their timing harness, which the examples and the
notebooks share."""

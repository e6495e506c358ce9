"""One-off investigations of the benchmarks' figures (see README.md here); not benchmarks."""

"""Hand-written kernels that XLA calls: C++ on the CPU (`cpu`), the Pallas decode attention on
GPUs (`gpu`); `seam` chooses a program's."""

// The count kernel compiled by the host compiler for the CPU model: the very source nvcc
// compiles, with csrc/device/device.cuh choosing the model's device layer.
#include "kernels/count.cu"

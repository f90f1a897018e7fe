// The device layer: everything the kernels use beyond plain C++. Under nvcc it is the GPU
// (CUDA builtins, PTX wrappers, cooperative launches); under a host compiler it is the CPU
// model of csrc/device/model/, which runs the same kernel sources as fibers and checks what
// the hardware would punish. Kernels include only this header, and contain no #if of their own.
#pragma once
#if defined(__CUDACC__)
#include "device/sm90/launch.cuh"
#include "device/sm90/primitives.cuh"
#else
#include "device/model/builtins.h"
#include "device/model/launch.h"
#include "device/model/primitives.h"
#endif

// Quantized linear layers (see tokenmill/model/quant.py); included by cpu_ops.cpp.
#pragma once

inline void register_quant_ops(pybind11::module_& m) {}

// Module checkpoints as safetensors files: a module's state_dict() under PyTorch's dotted names,
// so Python's safetensors.torch.load_file + load_state_dict reads what Tandem writes and back.
// Invariant: loading validates the whole file and every name and shape before any value changes.
#pragma once

#include <map>
#include <string>

#include "tandem/core/safetensors.h"
#include "tandem/nn/module.h"

namespace tandem::nn {

// Writes module.state_dict() (parameters and persistent buffers; a tied tensor under each of its
// names, as torch.save stores it) to `path` with save_safetensors: atomic, blocking until durable.
// Python reads it with safetensors.torch.load_file + load_state_dict; safetensors.torch.load_model
// expects a tied tensor under one name only and calls the second one unexpected. Throws what
// save_safetensors throws.
void save_state_dict(const Module& module, const std::string& path,
                     const std::map<std::string, std::string>& metadata = {});

// Loads the safetensors file at `path` into `module` with Module::load_state_dict: values are
// copied into the existing parameters (shared handles stay valid) and converted to each
// parameter's dtype when the file's differs (a bf16 file into an f32 model). A tensor the module
// holds under several names (tied weights) is loaded from whichever of its names the file has, as
// safetensors.torch.load_model does: Python's writer stores shared tensors once
// (safetensors.torch.save_model), Tandem's under every name. strict: otherwise the file's names
// and the module's must match both ways; not strict: only common names are copied, and when
// `incompatible` is given it receives the names left out (PyTorch's missing/unexpected keys).
// Returns the file's metadata. Throws IOError (from load_safetensors) for a missing or malformed
// file and ValueError naming the file, the tensor and both shapes for a missing/unexpected name
// or a shape mismatch; in every error case the module is unchanged.
std::map<std::string, std::string> load_state_dict_file(Module& module, const std::string& path, bool strict = true,
                                                        IncompatibleKeys* incompatible = nullptr);

}  // namespace tandem::nn

// Module checkpoints over the tensor-level safetensors reader and writer.
#include "tandem/nn/serialize.h"

namespace tandem::nn {

void save_state_dict(const Module& module, const std::string& path, const std::map<std::string, std::string>& metadata) {
  save_safetensors(path, module.state_dict(), metadata);
}

std::map<std::string, std::string> load_state_dict_file(Module& module, const std::string& path, bool strict) {
  SafetensorsFile file = load_safetensors(path);  // the whole file is validated before anything is copied
  try {
    module.load_state_dict(file.tensors, strict);  // checks every name and shape, then copies
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("load_state_dict_file: {}: {}", path, e.what()));
  }
  return std::move(file.metadata);
}

}  // namespace tandem::nn

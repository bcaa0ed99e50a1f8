// Module checkpoints over the tensor-level safetensors reader and writer.
#include "tandem/nn/serialize.h"

#include <unordered_map>

namespace tandem::nn {

void save_state_dict(const Module& module, const std::string& path, const std::map<std::string, std::string>& metadata) {
  save_safetensors(path, module.state_dict(), metadata);
}

std::map<std::string, std::string> load_state_dict_file(Module& module, const std::string& path, bool strict,
                                                        IncompatibleKeys* incompatible) {
  SafetensorsFile file = load_safetensors(path);  // the whole file is validated before anything is copied

  // Tied weights: a module name the file lacks whose tensor the file gives under another of its
  // names takes that value too, so that a file with one name per shared tensor loads strictly.
  std::unordered_map<std::string, const Tensor*> in_file;
  for (const auto& [name, t] : file.tensors) in_file.emplace(name, &t);
  const StateDict mine = module.state_dict();
  std::unordered_map<const TensorImpl*, const Tensor*> value_of;  // module tensor -> a file value for it
  for (const auto& [name, t] : mine)
    if (auto it = in_file.find(name); it != in_file.end()) value_of.emplace(&t.impl(), it->second);
  StateDict state = file.tensors;
  for (const auto& [name, t] : mine) {
    if (in_file.count(name) != 0) continue;
    if (auto it = value_of.find(&t.impl()); it != value_of.end()) state.emplace_back(name, *it->second);
  }

  IncompatibleKeys keys;
  try {
    keys = module.load_state_dict(state, strict);  // checks every name and shape, then copies
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("load_state_dict_file: {}: {}", path, e.what()));
  }
  if (incompatible != nullptr) *incompatible = std::move(keys);
  return std::move(file.metadata);
}

}  // namespace tandem::nn

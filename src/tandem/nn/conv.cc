#include "tandem/nn/conv.h"

#include <cmath>

#include "tandem/nn/init.h"

namespace tandem::nn {

Conv2d::Conv2d(int64_t in, int64_t out, std::array<int64_t, 2> k, const Conv2dOptions& o)
    : Module("Conv2d"), in_channels(in), out_channels(out), kernel_size(k), conv{o.stride, o.padding, o.dilation, o.groups} {
  TANDEM_CHECK(in > 0 && out > 0 && k[0] > 0 && k[1] > 0, ValueError,
               "Conv2d: channels and kernel size must be positive, got in={} out={} kernel=({}, {})", in, out, k[0], k[1]);
  TANDEM_CHECK(o.groups >= 1 && in % o.groups == 0 && out % o.groups == 0, ValueError,
               "Conv2d: groups={} must divide in_channels={} and out_channels={}", o.groups, in, out);
  weight = register_parameter("weight", empty({out, in / o.groups, k[0], k[1]}, o.dtype));
  if (o.bias) bias = register_parameter("bias", empty({out}, o.dtype));
  reset_parameters();
}

void Conv2d::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(init::fans(weight).first));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv2d::forward(const Tensor& x) { return ops::conv2d(x, weight, bias, conv); }

// PyTorch's Conv2d.extra_repr: padding, dilation and groups only when not the default.
std::string Conv2d::extra_repr() const {
  std::string s = fmt::format("{}, {}, kernel_size=({}, {}), stride=({}, {})", in_channels, out_channels, kernel_size[0],
                              kernel_size[1], conv.stride[0], conv.stride[1]);
  if (conv.padding[0] != 0 || conv.padding[1] != 0) s += fmt::format(", padding=({}, {})", conv.padding[0], conv.padding[1]);
  if (conv.dilation[0] != 1 || conv.dilation[1] != 1)
    s += fmt::format(", dilation=({}, {})", conv.dilation[0], conv.dilation[1]);
  if (conv.groups != 1) s += fmt::format(", groups={}", conv.groups);
  if (!bias.defined()) s += ", bias=False";
  return s;
}

}  // namespace tandem::nn

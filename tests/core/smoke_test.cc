#include "util/test_util.h"

namespace td = tandem;

TEST(Smoke, LinearGradcheck) {
  auto x = td::testing::leaf({3, 4}, -1, 1, 1);
  auto w = td::testing::leaf({5, 4}, -1, 1, 2);
  auto b = td::testing::leaf({5}, -1, 1, 3);
  EXPECT_TRUE(td::testing::gradcheck([](const std::vector<td::Tensor>& in) { return td::ops::linear(in[0], in[1], in[2]); },
                                     {x, w, b}));
}

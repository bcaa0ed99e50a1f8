// The `tandem` command itself: subcommand dispatch, help, version, and `tandem env`.
#include <gtest/gtest.h>

#include "tools/subprocess.h"

namespace tandem::testing {
namespace {

const std::string kTandem = TANDEM_CLI_PATH;

TEST(Cli, UnknownSubcommandIsNamedWithTheValidOnes) {
  ProcResult r = run_process({kTandem, "rnu"}, launcher_env());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown command \"rnu\""), std::string::npos) << r.err;
  const std::string valid = r.err.substr(std::min(r.err.size(), r.err.find("valid commands:")));
  for (const char* name : {"run", "env", "help", "version"})
    EXPECT_NE(valid.find(name), std::string::npos) << name << " missing in: " << r.err;
}

TEST(Cli, NoSubcommandPrintsUsageAndFails) {
  ProcResult r = run_process({kTandem}, launcher_env());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("usage: tandem <command>"), std::string::npos) << r.err;
}

TEST(Cli, HelpAndVersion) {
  ProcResult r = run_process({kTandem, "--help"}, launcher_env());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("run "), std::string::npos) << r.out;
  r = run_process({kTandem, "version"}, launcher_env());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out.rfind("tandem ", 0), 0u) << r.out;
  r = run_process({kTandem, "run", "--help"}, launcher_env());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--nproc-per-node N"), std::string::npos) << r.out;
}

TEST(Cli, EnvReportsCpuCoresAndBackends) {
  ProcResult r = run_process({kTandem, "env"}, launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* want : {"avx512_bf16", "amx_bf16", "cores allowed", "TANDEM_WITH_MPI", "shm ", "available"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << " missing in:\n" << r.out;
  r = run_process({kTandem, "env", "--bogus"}, launcher_env());
  EXPECT_EQ(r.exit_code, 2);
}

// `tandem env` says how bf16 products run and why (kernels/cpu/bf16_products.h); the variable
// TANDEM_BF16_GEMM overrides the choice, and an unknown value is named with the valid ones.
TEST(Cli, EnvSaysHowBf16ProductsRun) {
  ProcResult r = run_process({kTandem, "env"}, launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bf16 products    "), std::string::npos) << r.out;
  r = run_process({kTandem, "env"}, launcher_env({{"TANDEM_BF16_GEMM", "f32"}}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bf16 products    widened (TANDEM_BF16_GEMM=f32)"), std::string::npos) << r.out;
  r = run_process({kTandem, "env"}, launcher_env({{"TANDEM_BF16_GEMM", "onednn"}}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bf16 products    native (TANDEM_BF16_GEMM=onednn)"), std::string::npos) << r.out;
  r = run_process({kTandem, "env"}, launcher_env({{"TANDEM_BF16_GEMM", "fast"}}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("TANDEM_BF16_GEMM=\"fast\" is not a known way"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\"f32\""), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tandem::testing

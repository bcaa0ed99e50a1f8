// The subcommands of the `tandem` tool, one file each; tandem.cc dispatches on argv[1].
// Each takes the arguments after its name and returns the process exit code; errors are
// reported (message + non-zero code) inside, never by exit().
#pragma once

namespace tandem::tools {

int run_main(int argc, char** argv);              // tandem run: torchrun-compatible launcher (run.cc)
int bench_allreduce_main(int argc, char** argv);  // tandem bench allreduce (bench_allreduce.cc)
int env_main(int argc, char** argv);              // tandem env: what this machine and build offer (env.cc)
int train_main(int argc, char** argv);            // tandem train: the config-driven training job (train.cc)

}  // namespace tandem::tools

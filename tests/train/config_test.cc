// tandem train's config: DeepSpeed keys, the batch triple, overrides, and every error message
// naming the key, the value and the fix.
#include "tandem/train/config.h"

#include <algorithm>
#include <fstream>

#include <gtest/gtest.h>

#include "tandem/core/error.h"
#include "util/test_util.h"

namespace tandem::train {
namespace {

using nlohmann::json;

// The message of the ValueError `fn` throws ("" when it throws nothing or something else).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

json base() { return json::parse(R"({"train_batch_size": 32, "model": {"name": "mlp"}, "data": {"name": "fashion_mnist"}})"); }

TEST(Config, DefaultIsW1) {
  const Config c = parse_config(default_config_json());
  EXPECT_EQ(c.model.name, "mlp");
  EXPECT_EQ(c.model.hidden, (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(c.data.name, "fashion_mnist");
  EXPECT_EQ(c.train_batch_size, 128);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 128);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.optimizer.type, "SGD");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.05);
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.9);
  EXPECT_EQ(c.train.epochs, 1);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_FALSE(c.bf16);
  EXPECT_FALSE(c.data.drop_last);  // every image once per epoch, as the example
  // Linear decay from 0.05 to 0 over the run, no warmup.
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(c.scheduler.lr_at(0, 0.05, 469), 0.05);
  EXPECT_DOUBLE_EQ(c.scheduler.lr_at(469, 0.05, 469), 0.0);
  EXPECT_NEAR(c.scheduler.lr_at(234, 0.05, 469), 0.05 * 235.0 / 469.0, 1e-15);
  // The shipped W1 configs train the same recipe.
  for (const char* name : {"mlp_fp32", "mlp_bf16", "mlp_fp16"}) {
    const Config f = load_config(std::string(TANDEM_SOURCE_DIR) + "/configs/" + name + ".json", {});
    EXPECT_EQ(f.scheduler.type, c.scheduler.type) << name;
    EXPECT_EQ(f.scheduler.warmup_num_steps, 0) << name;
    EXPECT_DOUBLE_EQ(f.optimizer.lr, c.optimizer.lr) << name;
    EXPECT_DOUBLE_EQ(f.optimizer.momentum, c.optimizer.momentum) << name;
    EXPECT_EQ(f.train_batch_size, c.train_batch_size) << name;
  }
}

TEST(Config, ReadsDeepSpeedKeys) {
  const json j = json::parse(R"({
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 5, "seed": 7,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 4},
    "bf16": {"enabled": false}, "zero_optimization": {"stage": 0},
    "model": {"name": "gpt", "n_layer": 2, "d_model": 64, "n_head": 2, "context": 32},
    "data": {"name": "text", "samples_per_epoch": 100},
    "train": {"steps": 20, "eval_every": 5, "checkpoint_every": 10, "keep_last": 2},
    "amp": {"opt_level": "O2"}, "dist": {"backend": "gloo", "timeout_s": 30},
    "log": {"jsonl": true, "tensorboard": false}})");
  const Config c = parse_config(j, 2);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.betas[0], 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.scheduler.type, "WarmupCosineLR");
  EXPECT_EQ(c.scheduler.warmup_num_steps, 10);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 4);
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.train.steps, 20);
  EXPECT_EQ(c.opt_level, "O2");
  EXPECT_EQ(c.dist.backend, "gloo");
  EXPECT_FALSE(c.log.tensorboard);
}

TEST(Config, AdamWDefaultsToTorchWeightDecay) {
  json j = base();
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}};
  EXPECT_DOUBLE_EQ(parse_config(j).optimizer.weight_decay, 1e-2);
}

TEST(Config, BatchTripleDerivesTheMissingOne) {
  json j = base();
  j["train_micro_batch_size_per_gpu"] = 4;
  Config c = parse_config(j, 2);  // 32 = 4 * gas * 2
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  j.erase("train_micro_batch_size_per_gpu");
  j["gradient_accumulation_steps"] = 2;
  c = parse_config(j, 4);  // 32 = micro * 2 * 4
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  j.erase("train_batch_size");
  j["train_micro_batch_size_per_gpu"] = 3;
  c = parse_config(j, 3);
  EXPECT_EQ(c.train_batch_size, 18);
  j = base();
  c = parse_config(j, 4);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
}

TEST(Config, InconsistentBatchTripleShowsTheArithmetic) {
  json j = base();
  j["train_batch_size"] = 100;
  j["train_micro_batch_size_per_gpu"] = 16;
  j["gradient_accumulation_steps"] = 2;
  const std::string msg = error_of([&] { parse_config(j, 2); });
  EXPECT_NE(msg.find("train_batch_size 100 != train_micro_batch_size_per_gpu 16 * gradient_accumulation_steps 2 * "
                     "world size 2 = 64"),
            std::string::npos)
      << msg;
  j.erase("gradient_accumulation_steps");
  EXPECT_NE(error_of([&] { parse_config(j, 3); }).find("not a multiple of train_micro_batch_size_per_gpu 16 * world size 3 = 48"),
            std::string::npos);
  j = base();
  EXPECT_NE(error_of([&] { parse_config(j, 3); }).find("train_batch_size 32 is not a multiple of world size 3"),
            std::string::npos);
  j.erase("train_batch_size");
  EXPECT_NE(error_of([&] { parse_config(j); }).find("no batch size"), std::string::npos);
}

TEST(Config, UnknownKeyNamesTheNearestValidKey) {
  json j = base();
  j["zero_optimisation"] = {{"stage", 0}};
  EXPECT_EQ(error_of([&] { parse_config(j); }),
            "config: unknown key \"zero_optimisation\" (did you mean \"zero_optimization\"?)");
  j = base();
  j["optimizer"] = {{"type", "SGD"}, {"parms", {{"lr", 0.1}}}};
  EXPECT_EQ(error_of([&] { parse_config(j); }), "config: unknown key \"optimizer.parms\" (did you mean \"optimizer.params\"?)");
  j = base();
  j["optimizer"] = {{"type", "SGD"}, {"params", {{"learning_rate", 0.1}}}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("unknown key \"optimizer.params.learning_rate\""), std::string::npos);
  j = base();
  j["train"] = {{"stpes", 3}};
  EXPECT_EQ(error_of([&] { parse_config(j); }), "config: unknown key \"train.stpes\" (did you mean \"train.steps\"?)");
  // A key in the wrong section: the nearest key anywhere.
  j = base();
  j["keep_last"] = 2;
  EXPECT_EQ(error_of([&] { parse_config(j); }), "config: unknown key \"keep_last\" (did you mean \"train.keep_last\"?)");
  // An exact name elsewhere beats a sibling two edits away ("lr" is not "log").
  j = base();
  j["lr"] = 0.1;
  EXPECT_EQ(error_of([&] { parse_config(j); }), "config: unknown key \"lr\" (did you mean \"optimizer.params.lr\"?)");
}

TEST(Config, WrongTypeOrRangeNamesKeyValueAndExpectation) {
  const auto err = [](const char* path, json v) {
    json j = base();
    apply_override(j, std::string(path) + "=" + v.dump());
    return error_of([&] { parse_config(j); });
  };
  EXPECT_EQ(err("train_batch_size", "big"), "config: \"train_batch_size\" is \"big\", expected an integer >= 1");
  EXPECT_EQ(err("train_batch_size", 0), "config: \"train_batch_size\" is 0, expected an integer >= 1");
  EXPECT_EQ(err("train_batch_size", 2.5), "config: \"train_batch_size\" is 2.5, expected an integer >= 1");
  EXPECT_EQ(err("optimizer.params.lr", -1), "config: \"optimizer.params.lr\" is -1, expected a number >= 0");
  EXPECT_EQ(err("optimizer.params.momentum", 1.5), "config: \"optimizer.params.momentum\" is 1.5, expected a number in [0, 1]");
  EXPECT_EQ(err("optimizer.type", "Lamb"), "config: \"optimizer.type\" is \"Lamb\", expected one of \"SGD\", \"Adam\", \"AdamW\"");
  EXPECT_EQ(err("fp16.enabled", "yes"), "config: \"fp16.enabled\" is \"yes\", expected true or false");
  EXPECT_EQ(err("optimizer.params.betas", json::array({0.9})),
            "config: \"optimizer.params.betas\" is [0.9], expected a list of two numbers in [0, 1)");
  EXPECT_EQ(err("model.hidden", json::array({64, 0})), "config: \"model.hidden\" is [64,0], expected a non-empty list of integers >= 1");
  EXPECT_EQ(err("zero_optimization.stage", 4), "config: \"zero_optimization.stage\" is 4, expected an integer in [0, 3]");
  // Beyond 2^53 a JSON number is no exact integer, and beyond int64 its conversion was undefined
  // (a batch of -2446744073709551616 trained; train.steps 1e19 became one epoch).
  EXPECT_EQ(err("train.steps", 1e19), "config: \"train.steps\" is 1e+19, expected an integer >= 0 and at most 2^53");
  EXPECT_EQ(err("train_micro_batch_size_per_gpu", 4e18),
            "config: \"train_micro_batch_size_per_gpu\" is 4e+18, expected an integer >= 1 and at most 2^53");
  EXPECT_EQ(err("model.hidden", json::array({64, 1e300})),
            "config: \"model.hidden\" is [64,1e+300], expected a non-empty list of integers >= 1");
  // A timeout whose deadline in milliseconds would overflow (it failed at once, as a timeout).
  EXPECT_EQ(err("dist.timeout_s", 1e10), "config: \"dist.timeout_s\" is 10000000000.0, expected a number in [0.001, 1000000]");
  EXPECT_EQ(err("model", 3), "config: \"model\" is 3, expected an object with keys: name, hidden, num_classes, vocab_size, "
                             "context, n_layer, d_model, n_head");
}

TEST(Config, Fp16AndBf16TogetherIsAnError) {
  json j = base();
  j["fp16"] = {{"enabled", true}};
  j["bf16"] = {{"enabled", true}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"fp16.enabled\" and \"bf16.enabled\" are both true"), std::string::npos);
}

TEST(Config, ZeroStagesAboveZeroAreNotImplementedYet) {
  json j = base();
  j["zero_optimization"] = {{"stage", 2}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"zero_optimization.stage\" is 2: ZeRO stages 1-3 are not implemented yet"),
            std::string::npos);
}

TEST(Config, DdpSectionAndCommunicationDataType) {
  // Defaults: PyTorch's DDP arguments, f32 on the wire.
  Config c = parse_config(base());
  EXPECT_EQ(c.ddp.options.bucket_cap_mb, 25.0);
  EXPECT_TRUE(c.ddp.options.broadcast_buffers);
  EXPECT_FALSE(c.ddp.options.find_unused_parameters || c.ddp.options.gradient_as_bucket_view || c.ddp.options.static_graph || c.ddp.sync_batchnorm ||
               c.ddp.options.delay_allreduce);
  EXPECT_EQ(c.ddp.comm_hook, "no");
  EXPECT_EQ(c.ddp.options.check_replicas_every, 0);

  json j = base();
  j["ddp"] = {{"bucket_cap_mb", 4.5},     {"broadcast_buffers", false}, {"find_unused_parameters", true},
              {"gradient_as_bucket_view", true}, {"static_graph", true},  {"comm_hook", "fp16"},
              {"sync_batchnorm", true},   {"check_replicas_every", 7},  {"delay_allreduce", true}};
  c = parse_config(j);
  EXPECT_EQ(c.ddp.options.bucket_cap_mb, 4.5);
  EXPECT_FALSE(c.ddp.options.broadcast_buffers);
  EXPECT_TRUE(c.ddp.options.find_unused_parameters && c.ddp.options.gradient_as_bucket_view && c.ddp.options.static_graph && c.ddp.sync_batchnorm);
  EXPECT_EQ(c.ddp.comm_hook, "fp16");
  EXPECT_EQ(c.ddp.options.check_replicas_every, 7);
  EXPECT_TRUE(c.ddp.options.delay_allreduce);

  // DeepSpeed's communication_data_type is the same setting (bfp16 is DeepSpeed's alias of bf16).
  for (const auto& [type, hook] : std::vector<std::pair<std::string, std::string>>{
           {"fp32", "no"}, {"fp16", "fp16"}, {"bf16", "bf16"}, {"bfp16", "bf16"}}) {
    j = base();
    j["communication_data_type"] = type;
    EXPECT_EQ(parse_config(j).ddp.comm_hook, hook) << type;
    j["ddp"] = {{"comm_hook", hook}};  // agreeing: fine
    EXPECT_EQ(parse_config(j).ddp.comm_hook, hook) << type;
  }
  j = base();
  j["communication_data_type"] = "fp16";
  j["ddp"] = {{"comm_hook", "bf16"}};
  EXPECT_NE(error_of([&] { parse_config(j); })
                .find("\"communication_data_type\" \"fp16\" and \"ddp.comm_hook\" \"bf16\" disagree"),
            std::string::npos);
  j["communication_data_type"] = "FP16";
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"communication_data_type\" is \"FP16\", expected one of \"fp32\""),
            std::string::npos);

  // PowerSGD: Accelerate's value and comm_state_option (PyTorch's PowerSGDState arguments).
  j = base();
  j["ddp"] = {{"comm_hook", "power_sgd"},
              {"comm_state_option", {{"matrix_approximation_rank", 4}, {"start_powerSGD_iter", 10}, {"warm_start", false},
                                     {"min_compression_rate", 1.5}, {"orthogonalization_epsilon", 1e-8},
                                     {"use_error_feedback", false}, {"random_seed", 7}}}};
  c = parse_config(j);
  EXPECT_EQ(c.ddp.comm_hook, "power_sgd");
  EXPECT_EQ(c.ddp.power_sgd.matrix_approximation_rank, 4);
  EXPECT_EQ(c.ddp.power_sgd.start_powerSGD_iter, 10);
  EXPECT_FALSE(c.ddp.power_sgd.warm_start || c.ddp.power_sgd.use_error_feedback);
  EXPECT_EQ(c.ddp.power_sgd.min_compression_rate, 1.5);
  EXPECT_EQ(c.ddp.power_sgd.orthogonalization_epsilon, 1e-8);
  EXPECT_EQ(c.ddp.power_sgd.random_seed, 7u);
  j["ddp"] = {{"comm_hook", "power_sgd"}};
  EXPECT_EQ(parse_config(j).ddp.power_sgd.start_powerSGD_iter, 1000);  // PyTorch's default
  // The wire dtype of PowerSGD's factors: comm_wrapper (Accelerate), or communication_data_type.
  for (const auto& [type, wrapper] : std::vector<std::pair<std::string, std::string>>{
           {"fp32", "no"}, {"fp16", "fp16"}, {"bf16", "bf16"}, {"bfp16", "bf16"}}) {
    j["communication_data_type"] = type;
    c = parse_config(j);
    EXPECT_EQ(c.ddp.comm_hook, "power_sgd") << type;
    EXPECT_EQ(c.ddp.comm_wrapper, wrapper) << type;
  }
  j["ddp"]["comm_wrapper"] = "bf16";  // bfp16 is bf16: they agree
  EXPECT_EQ(parse_config(j).ddp.comm_wrapper, "bf16");
  j["communication_data_type"] = "fp16";
  EXPECT_NE(error_of([&] { parse_config(j); })
                .find("\"communication_data_type\" \"fp16\" and \"ddp.comm_wrapper\" \"bf16\" disagree"),
            std::string::npos);
  j.erase("communication_data_type");
  EXPECT_EQ(parse_config(j).ddp.comm_wrapper, "bf16");
  j["ddp"] = {{"comm_hook", "fp16"}, {"comm_wrapper", "fp16"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"ddp.comm_wrapper\" \"fp16\" wraps PowerSGD"), std::string::npos);
  j["ddp"] = {{"comm_hook", "power_sgd"}};
  j["ddp"]["comm_state_option"] = {{"start_powerSGD_iter", 1}};
  EXPECT_NE(error_of([&] { parse_config(j); })
                .find("\"ddp.comm_state_option.start_powerSGD_iter\" is 1: it must be > 1 with use_error_feedback"),
            std::string::npos);
  j["ddp"] = {{"comm_state_option", {{"matrix_approximation_rank", 2}}}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"ddp.comm_state_option.matrix_approximation_rank\" configures PowerSGD, but \"ddp.comm_hook\" is \"no\""),
            std::string::npos);
  j["ddp"] = {{"comm_hook", "batched_power_sgd"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"batched_power_sgd\" is not offered by tandem train: its state is per bucket"),
            std::string::npos);
  j["ddp"] = {{"comm_hook", "powersgd"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"ddp.comm_hook\" is \"powersgd\", expected one of \"no\""),
            std::string::npos);
  j["ddp"] = {{"bucket_cap", 10}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("unknown key \"ddp.bucket_cap\" (did you mean \"ddp.bucket_cap_mb\"?)"),
            std::string::npos);
  j["ddp"] = {{"bucket_cap_mb", 0}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"ddp.bucket_cap_mb\" is 0, expected a number >= 1e-06"),
            std::string::npos);

  // Deterministic mode: a power-of-two micro-batch count per rank, a model without BatchNorm, the
  // exact gradients.
  j = base();  // batch 32
  j["train_micro_batch_size_per_gpu"] = 4;
  j["ddp"] = {{"deterministic", true}};
  EXPECT_TRUE(parse_config(j, 2).ddp.options.deterministic);  // 4 per rank
  j["train_batch_size"] = 24;
  EXPECT_NE(error_of([&] { parse_config(j, 2); })
                .find("needs a power-of-two number of them per step; this run has 3 (train_batch_size 24 = micro-batch 4 x "
                      "accumulation 3 x 2 processes)"),
            std::string::npos);
  j["train_batch_size"] = 32;
  j["model"] = {{"name", "cnn"}};
  EXPECT_NE(error_of([&] { parse_config(j, 2); }).find("\"ddp.deterministic\" with model \"cnn\": its BatchNorm running"),
            std::string::npos);
  j["model"] = {{"name", "mlp"}};
  j["ddp"]["comm_hook"] = "bf16";
  EXPECT_NE(error_of([&] { parse_config(j, 2); }).find("drop \"ddp.comm_hook\" \"bf16\""), std::string::npos);
  j["ddp"].erase("comm_hook");
  j["communication_data_type"] = "fp16";
  EXPECT_NE(error_of([&] { parse_config(j, 2); }).find("drop \"communication_data_type\" \"fp16\""), std::string::npos);

  // O2 keeps bf16 parameters: their gradients go in bf16 whatever is asked; asking for another
  // wire dtype is an error, asking for theirs is a no-op.
  j = base();
  j["bf16"] = {{"enabled", true}};
  j["amp"] = {{"opt_level", "O2"}};
  j["communication_data_type"] = "bf16";
  EXPECT_EQ(parse_config(j).ddp.comm_hook, "no");
  j["communication_data_type"] = "fp32";
  EXPECT_NE(error_of([&] { parse_config(j); }).find("amp.opt_level O2 keeps bf16 parameters, whose gradients are reduced in bf16 (f32 "
                                                  "accumulation); communication_data_type \"fp32\" applies"),
            std::string::npos);
  j.erase("communication_data_type");
  j["ddp"] = {{"comm_hook", "fp16"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("ddp.comm_hook \"fp16\" applies to f32 gradients only"), std::string::npos);
  j["ddp"] = {{"comm_hook", "power_sgd"}, {"comm_wrapper", "fp16"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("ddp.comm_wrapper \"fp16\" applies to f32 gradients only"),
            std::string::npos);
  j["ddp"] = {{"comm_hook", "power_sgd"}};  // PowerSGD compresses the bf16 gradients themselves
  c = parse_config(j);
  EXPECT_EQ(c.ddp.comm_hook, "power_sgd");
  EXPECT_EQ(c.ddp.comm_wrapper, "no");
  j["amp"] = {{"opt_level", "O1"}};  // autocast keeps f32 parameters: both apply
  EXPECT_EQ(parse_config(j).ddp.comm_hook, "power_sgd");
  j["ddp"] = {{"comm_hook", "fp16"}};
  EXPECT_EQ(parse_config(j).ddp.comm_hook, "fp16");
}

// Post-local SGD: torch's PostLocalSGDState and PeriodicModelAverager arguments, with torch's
// defaults (post_local_gradient_allreduce true, averaging from start_localSGD_iter) and the
// combinations that cannot work refused by name.
TEST(Config, PostLocalSgd) {
  json j = base();
  j["ddp"] = {{"comm_hook", "post_local_sgd"}, {"model_averaging", {{"period", 4}}}};
  Config c = parse_config(j, 4);
  EXPECT_EQ(c.ddp.comm_hook, "post_local_sgd");
  EXPECT_EQ(c.ddp.post_local.start_localSGD_iter, 0);
  EXPECT_TRUE(c.ddp.post_local.post_local_gradient_allreduce);
  EXPECT_EQ(c.ddp.subgroup_size, 0);
  EXPECT_EQ(c.ddp.averaging_period, 4);
  EXPECT_EQ(c.ddp.averaging_warmup_steps, 0);
  j["ddp"]["comm_state_option"] = {{"start_localSGD_iter", 10}, {"post_local_gradient_allreduce", false}, {"subgroup_size", 2}};
  c = parse_config(j, 4);
  EXPECT_EQ(c.ddp.post_local.start_localSGD_iter, 10);
  EXPECT_FALSE(c.ddp.post_local.post_local_gradient_allreduce);
  EXPECT_EQ(c.ddp.subgroup_size, 2);
  EXPECT_EQ(c.ddp.averaging_warmup_steps, 10);  // torch's advice: average from where local SGD starts
  j["ddp"]["model_averaging"]["warmup_steps"] = 12;
  EXPECT_EQ(parse_config(j, 4).ddp.averaging_warmup_steps, 12);
  // bf16 O2: the hook reduces the bf16 gradients as they are.
  json o2 = j;
  o2["bf16"] = {{"enabled", true}};
  o2["amp"] = {{"opt_level", "O2"}};
  EXPECT_EQ(parse_config(o2, 4).ddp.comm_hook, "post_local_sgd");

  j["ddp"]["comm_state_option"]["subgroup_size"] = 3;
  EXPECT_NE(error_of([&] { parse_config(j, 4); })
                .find("\"ddp.comm_state_option.subgroup_size\" 3 does not divide the 4 processes into equal groups"),
            std::string::npos);
  j["ddp"]["comm_state_option"]["subgroup_size"] = 2;
  j["ddp"]["model_averaging"].erase("period");
  EXPECT_NE(error_of([&] { parse_config(j, 4); }).find("needs one of \"ddp.model_averaging.period\""), std::string::npos);
  EXPECT_NE(error_of([&] { parse_config(j, 4); }).find("got neither"), std::string::npos);
  j["ddp"]["model_averaging"]["period"] = 0;
  EXPECT_NE(error_of([&] { parse_config(j, 4); }).find("ddp.model_averaging.period"), std::string::npos);
  j["ddp"]["model_averaging"]["period"] = 4;
  j["ddp"]["check_replicas_every"] = 5;
  EXPECT_NE(error_of([&] { parse_config(j, 4); })
                .find("\"ddp.check_replicas_every\" 5 with \"ddp.comm_hook\" \"post_local_sgd\": between averagings"),
            std::string::npos);
  j["ddp"].erase("check_replicas_every");
  j["communication_data_type"] = "bf16";
  EXPECT_NE(error_of([&] { parse_config(j, 4); })
                .find("\"communication_data_type\" \"bf16\" with \"ddp.comm_hook\" \"post_local_sgd\""),
            std::string::npos);
  j["communication_data_type"] = "fp32";
  EXPECT_EQ(parse_config(j, 4).ddp.comm_hook, "post_local_sgd");
  // HierarchicalModelAverager's levels instead of a period.
  json h = base();
  h["ddp"] = {{"comm_hook", "post_local_sgd"}, {"model_averaging", {{"hierarchy", {{2, 2}, {8, 4}}}}}};
  c = parse_config(h, 4);
  EXPECT_EQ(c.ddp.averaging_hierarchy, (std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {8, 4}}));
  EXPECT_EQ(c.ddp.averaging_period, 0);
  h["ddp"]["model_averaging"]["period"] = 4;
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("needs one of \"ddp.model_averaging.period\""), std::string::npos);
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("not both"), std::string::npos);
  h["ddp"]["model_averaging"].erase("period");
  h["ddp"]["model_averaging"]["hierarchy"] = {{8, 2}, {2, 4}};
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("[[8,2],[2,4]]: the periods must increase"), std::string::npos);
  h["ddp"]["model_averaging"]["hierarchy"] = {{2, 3}, {8, 4}};
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("group size 3 does not divide the 4 processes"), std::string::npos);
  h["ddp"]["model_averaging"]["hierarchy"] = {{2, 2}};
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("must average over all 4 processes (torch's rule); end it with [period, 4]"),
            std::string::npos);
  h["ddp"]["model_averaging"]["hierarchy"] = {{2, 0}};
  EXPECT_NE(error_of([&] { parse_config(h, 4); }).find("expected a non-empty list of [integer >= 1, integer >= 1] pairs"),
            std::string::npos);

  // Its options under another hook, and PowerSGD's under this one, are named.
  json k = base();
  k["ddp"] = {{"comm_hook", "power_sgd"}, {"comm_state_option", {{"start_localSGD_iter", 3}}}};
  EXPECT_NE(error_of([&] { parse_config(k); })
                .find("\"ddp.comm_state_option.start_localSGD_iter\" configures post-local SGD, but \"ddp.comm_hook\" is "
                      "\"power_sgd\""),
            std::string::npos);
  k["ddp"] = {{"model_averaging", {{"period", 2}}}};
  EXPECT_NE(error_of([&] { parse_config(k); }).find("\"ddp.model_averaging\" configures post-local SGD"), std::string::npos);
  k["ddp"] = {{"comm_hook", "post_local_sgd"}, {"model_averaging", {{"period", 2}}}, {"comm_state_option", {{"warm_start", false}}}};
  EXPECT_NE(error_of([&] { parse_config(k); })
                .find("\"ddp.comm_state_option.warm_start\" configures PowerSGD, but \"ddp.comm_hook\" is \"post_local_sgd\""),
            std::string::npos);
  k["ddp"] = {{"comm_hook", "post_local_sgd"}, {"model_averaging", {{"period", 2}}}, {"deterministic", true}};
  EXPECT_NE(error_of([&] { parse_config(k); }).find("drop \"ddp.comm_hook\" \"post_local_sgd\""), std::string::npos);
}

TEST(Config, CrossFieldChecks) {
  json j = base();
  j["model"]["name"] = "gpt";
  EXPECT_NE(error_of([&] { parse_config(j); }).find("model \"gpt\" does not fit data \"fashion_mnist\""), std::string::npos);
  j = base();
  j["optimizer"] = {{"type", "Adam"}, {"params", {{"momentum", 0.9}}}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("apply to SGD only"), std::string::npos);
  j = base();
  j["amp"] = {{"opt_level", "O2"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("needs a low precision"), std::string::npos);
  j = base();
  j["train"] = {{"steps", 0}, {"epochs", 0}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("both 0"), std::string::npos);
}

// ddp.fused_optimizer steps inside backward: whatever needs every gradient before the step is
// refused, naming both keys.
TEST(Config, FusedOptimizerRefusesWhatNeedsEveryGradientFirst) {
  json j = base();
  EXPECT_FALSE(parse_config(j).ddp.fused_optimizer);
  j["ddp"] = {{"fused_optimizer", true}};
  EXPECT_TRUE(parse_config(j).ddp.fused_optimizer);
  j["bf16"] = {{"enabled", true}};
  EXPECT_TRUE(parse_config(j).ddp.fused_optimizer);  // bf16 autocast needs no scaler
  j = base();
  j["ddp"] = {{"fused_optimizer", true}};
  j["gradient_clipping"] = 1.0;
  EXPECT_NE(error_of([&] { parse_config(j); }).find("before \"gradient_clipping\" 1 could clip"), std::string::npos);
  j = base();
  j["ddp"] = {{"fused_optimizer", true}};
  j["fp16"] = {{"enabled", true}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("before fp16's loss scaler could unscale"), std::string::npos);
  j = base();
  j["ddp"] = {{"fused_optimizer", true}};
  j["bf16"] = {{"enabled", true}};
  j["amp"] = {{"opt_level", "O2"}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("\"ddp.fused_optimizer\" with amp.opt_level O2"), std::string::npos);
  j["ddp"] = {{"fused_optimizer", 1}};
  EXPECT_NE(error_of([&] { parse_config(j); }).find("ddp.fused_optimizer"), std::string::npos);
}

TEST(Config, OverridesParseJsonOrStrings) {
  json j = base();
  apply_override(j, "optimizer.params.lr=0.25");
  apply_override(j, "model.hidden=[16,8]");
  apply_override(j, "data.path=/tmp/x y");
  apply_override(j, "log.tensorboard=false");
  const Config c = parse_config(j);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.25);
  EXPECT_EQ(c.model.hidden, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(c.data.path, "/tmp/x y");
  EXPECT_FALSE(c.log.tensorboard);
  EXPECT_NE(error_of([&] { apply_override(j, "novalue"); }).find("expected key.path=value"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_override(j, "a..b=1"); }).find("empty component"), std::string::npos);
  // A typo in --set is caught like one in the file.
  apply_override(j, "optimizer.params.lrr=1");
  EXPECT_NE(error_of([&] { parse_config(j); }).find("did you mean \"optimizer.params.lr\""), std::string::npos);
}

TEST(Config, LoadConfigReadsFileAndReportsBadJson) {
  tandem::testing::TempDir dir;
  const std::string good = dir.path() + "/good.json", bad = dir.path() + "/bad.json";
  std::ofstream(good) << base().dump();
  std::ofstream(bad) << "{\"train_batch_size\": ";
  const Config c = load_config(good, {"train_batch_size=64"});
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_THROW(load_config(bad, {}), IOError);
  // A key given twice in one object (JSON parsers keep the last without a word): named.
  const std::string twice = dir.path() + "/twice.json", nested = dir.path() + "/nested.json";
  std::ofstream(twice) << R"({"train_batch_size": 32, "train_batch_size": 64})";
  std::ofstream(nested) << R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "lr": 0.2}}, "train_batch_size": 8})";
  EXPECT_EQ(error_of([&] { load_config(twice, {}); }), "config: \"" + twice + "\" gives \"train_batch_size\" twice; keep one");
  EXPECT_EQ(error_of([&] { load_config(nested, {}); }), "config: \"" + nested + "\" gives \"optimizer.params.lr\" twice; keep one");
  EXPECT_EQ(load_config("", {}).model.hidden.size(), 2u);
  // An unreadable path says why.
  auto io_error_of = [](const std::string& path) {
    try {
      load_config(path, {});
    } catch (const IOError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(io_error_of(dir.path() + "/missing.json").find("missing.json\": No such file or directory"), std::string::npos);
  EXPECT_NE(io_error_of(dir.path()).find("is a directory; give the JSON file"), std::string::npos);
}

// What tandem train's ranks compare at start-up: every key of the table but the rank-local ones,
// written by value, "unset" where not given.
TEST(Config, SharedConfigLinesCoverEveryKeyButTheRankLocalOnes) {
  const std::vector<std::string> lines = shared_config_lines(base());
  const auto has = [&](const std::string& line) { return std::find(lines.begin(), lines.end(), line) != lines.end(); };
  EXPECT_TRUE(has("train_batch_size = 32"));
  EXPECT_TRUE(has("model.name = \"mlp\""));
  EXPECT_TRUE(has("optimizer.params.lr = unset"));
  for (const std::string& line : lines) {
    const std::string key = line.substr(0, line.find(" = "));
    EXPECT_FALSE(is_rank_local_key(key)) << line;
  }
  EXPECT_EQ(rank_local_keys(),
            (std::vector<std::string>{"data.path", "data.num_workers", "train.threads", "dist.timeout_s", "log.progress"}));
  for (const std::string& k : rank_local_keys()) EXPECT_TRUE(is_rank_local_key(k)) << k;
  EXPECT_FALSE(is_rank_local_key("data.name"));
  EXPECT_FALSE(is_rank_local_key("dist.backend"));

  // Equal by value: 32 and 32.0, [0.9, 0.999] written either way, null as not given; the
  // rank-local keys do not count.
  json same = base();
  same["train_batch_size"] = 32.0;
  same["optimizer"] = {{"params", {{"betas", {0.9, 0.999}}, {"lr", nullptr}}}};
  same["data"]["path"] = "/node1/data";
  same["train"] = {{"threads", 4}};
  json with_betas = base();
  with_betas["optimizer"] = {{"params", {{"betas", {0.90, 0.9990}}}}};
  with_betas["train"] = {{"threads", 1}};
  EXPECT_EQ(shared_config_lines(same), shared_config_lines(with_betas));

  // Any other difference shows, also a default written out on one side only (the ranks cannot
  // tell that the value is the default; the error asks for the same config everywhere).
  json other = with_betas;
  other["seed"] = 0;
  EXPECT_NE(shared_config_lines(other), shared_config_lines(with_betas));
  other = with_betas;
  other["model"]["hidden"] = {512, 1024};
  const auto a = shared_config_lines(with_betas), b = shared_config_lines(other);
  ASSERT_EQ(a.size(), b.size());
  size_t i = 0;
  while (a[i] == b[i]) ++i;
  EXPECT_EQ(a[i], "model.hidden = unset");
  EXPECT_EQ(b[i], "model.hidden = [512, 1024]");
}

TEST(Config, ShippedConfigsParse) {
  for (const char* model : {"mlp", "cnn", "gpt"}) {
    for (const char* precision : {"fp32", "bf16", "fp16"}) {
      const std::string name = std::string(model) + "_" + precision + ".json";
      SCOPED_TRACE(name);
      const Config c = load_config(std::string(TANDEM_SOURCE_DIR) + "/configs/" + name, {}, 1);
      EXPECT_EQ(c.model.name, model);
      EXPECT_EQ(c.bf16, std::string(precision) == "bf16");
      EXPECT_EQ(c.fp16.enabled, std::string(precision) == "fp16");
    }
  }
}

TEST(Config, DeepSpeedSchedules) {
  SchedulerConfig s;
  s.type = "WarmupLR";
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 0.1;
  s.warmup_num_steps = 10;
  s.warmup_type = "linear";
  EXPECT_DOUBLE_EQ(s.lr_at(0, 1.0, 100), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(5, 1.0, 100), 0.05);
  EXPECT_DOUBLE_EQ(s.lr_at(50, 1.0, 100), 0.1);
  s.warmup_type = "log";
  EXPECT_NEAR(s.lr_at(4, 1.0, 100), 0.1 * std::log(5.0) / std::log(10.0), 1e-15);
  s.type = "WarmupDecayLR";
  s.warmup_type = "linear";
  EXPECT_DOUBLE_EQ(s.lr_at(55, 1.0, 100), 0.05);  // halfway from step 10 to 100
  EXPECT_DOUBLE_EQ(s.lr_at(100, 1.0, 100), 0.0);
  // DeepSpeed's WarmupDecayLR decays to warmup_min_lr, not to 0: min + (max - min) * gamma.
  s.warmup_min_lr = 0.01;
  EXPECT_DOUBLE_EQ(s.lr_at(55, 1.0, 100), 0.055);
  EXPECT_DOUBLE_EQ(s.lr_at(100, 1.0, 100), 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(150, 1.0, 100), 0.01);
  s.warmup_min_lr = 0.0;
  s.type = "WarmupCosineLR";
  s.warmup_min_ratio = 0.0;
  s.cos_min_ratio = 0.1;
  EXPECT_DOUBLE_EQ(s.lr_at(10, 2.0, 110), 2.0);
  EXPECT_NEAR(s.lr_at(60, 2.0, 110), 2.0 * (0.1 + 0.9 * 0.5), 1e-12);
  EXPECT_NEAR(s.lr_at(110, 2.0, 110), 0.2, 1e-12);
  SchedulerConfig none;
  EXPECT_DOUBLE_EQ(none.lr_at(7, 0.3, 10), 0.3);
}

// Keys the chosen schedule, optimizer or dataset does not take were accepted and ignored; DeepSpeed
// passes scheduler params as keyword arguments (TypeError), torch's SGD takes no eps.
TEST(Config, KeysTheChosenPartDoesNotTakeAreErrors) {
  json j = base();
  j["scheduler"] = {{"type", "WarmupCosineLR"}, {"params", {{"warmup_max_lr", 5}}}};
  std::string m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("\"scheduler.params.warmup_max_lr\" is not a parameter of WarmupCosineLR"), std::string::npos) << m;
  j["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"total_num_steps", 100}}}};
  m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("is not a parameter of WarmupLR"), std::string::npos) << m;
  j["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", 100}, {"warmup_min_lr", 0.01}}}};
  EXPECT_EQ(error_of([&] { parse_config(j); }), "");
  j = base();
  j["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.1}, {"eps", 1e-8}}}};
  m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("apply to Adam/AdamW only"), std::string::npos) << m;
  j = base();
  j["data"]["samples_per_epoch"] = 1000;
  m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("\"data.samples_per_epoch\" applies to text and tokens data"), std::string::npos) << m;
}

// micro * accumulation * world wrapped in int64: (2^32 + 1)^2 = 2^33 + 1 (mod 2^64) passed the
// consistency check, and 2^32 * 2^32 gave "batch 0".
TEST(Config, BatchProductsThatOverflowAreErrors) {
  json j = base();
  j["train_batch_size"] = 8589934593.0;
  j["train_micro_batch_size_per_gpu"] = 4294967297.0;
  j["gradient_accumulation_steps"] = 4294967297.0;
  std::string m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("batch sizes too large"), std::string::npos) << m;
  j.erase("train_batch_size");
  j["train_micro_batch_size_per_gpu"] = 4294967296.0;
  j["gradient_accumulation_steps"] = 4294967296.0;
  m = error_of([&] { parse_config(j); });
  EXPECT_NE(m.find("overflows"), std::string::npos) << m;
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3);
  EXPECT_EQ(edit_distance("", "abc"), 3);
  EXPECT_EQ(edit_distance("same", "same"), 0);
}

}  // namespace
}  // namespace tandem::train

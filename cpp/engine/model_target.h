// model_target.h: adapts a TargetModel (cpp/model/model.h: the CPU model, later the CUDA one)
// to the engine's Target interface (target.h). The two interfaces have the same cache
// semantics (pending window, commit packs kept entries); this only forwards the calls.
#pragma once
#include "engine/target.h"
#include "model/model.h"

namespace kdtree {

class ModelTarget : public Target {
 public:
  explicit ModelTarget(TargetModel& model) : model_(model) {}
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  int64_t max_seq_len() const override { return model_.max_seq_len(); }
  int64_t cache_len() const override { return model_.cache_len(); }
  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
               float* logits_out) override {
    model_.forward(tokens, positions, visibility, T, logits_out);
  }
  void forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                    int64_t rows, float* logits_out) override {
    model_.forward_last(tokens, positions, visibility, T, rows, logits_out);
  }
  void commit(const int32_t* keep, int64_t n) override { model_.commit(keep, n); }
  void reset() override { model_.reset(); }
  void truncate(int64_t n) override { model_.truncate(n); }
  bool cache_epoch(uint64_t* out) const override { return model_.cache_epoch(out); }
  TargetModel& model() { return model_; }

 private:
  TargetModel& model_;
};

}  // namespace kdtree

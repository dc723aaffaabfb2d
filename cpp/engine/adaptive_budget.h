// adaptive_budget.h: each round's tree size chosen from the draft itself (GenerateParams::
// adaptive_budget; docs/ENGINE.md "Adaptive tree budget").
//
// A fixed budget B verifies B nodes whatever the draft says; where the drafter is unsure, most
// of them are rejected and their verify cost is lost, and where it is sure, a larger tree would
// pay. Here the round's best-first tree of up to B nodes is built on the host from the draft
// (the same pops the executor makes, so its first n nodes are exactly the tree of budget n), and
// n is the size that maximises the expected tokens per second of the round:
//
//   rate(n) = (1 + sum_{i <= n} p_i) / (t_draft + t_round(n + 1))
//
// p_i = the chance node i is on the accepted path = p_parent x min(1, q x f(q)), q = the draft's
// probability of the node's own token at its depth (the edge from its parent), f = a calibration
// factor learned from what the target did, per band of q ([2^-(b+1), 2^-b)) with exponential
// forgetting (f = (hits + 0.25) / (mass + 0.25): a prior of a quarter of an edge at the draft's
// word); 1 + sum p_i is the expected tokens emitted (the bonus token always). Calibrating
// edges, not whole paths, matters for drafters that are sure all the way down (an n-gram match
// gives q = 1 at every depth: a path probability of 1 at depth 8 would say nothing about depth).
// The tree is built in the calibrated order: the draft's rows rewritten to log q + log f(q) (capped
// at 0, each row re-sorted descending, ties in the draft's order), which the round is given too
// (draft_logprobs / draft_ids), so its first n nodes are the n likeliest by what the target did.
// f learns from every node of every round's tree of B nodes, verified or not: once the generated
// text has a tree's depth t (depth by depth, not only once it has passed the whole tree), a node at
// t whose parent matched the text "would have been accepted" iff its token is the text's next one
// (what the accept walk takes at temperature 0, and its distribution when sampling). Learning from
// the verified nodes only would trap it: a bad stretch drives the sizes to 0, after which nothing
// more is learned even once the drafter is right again. t_round(T) = the measured wall time of a
// round of T tokens (tree build, verify forward, choice, accept, commit; an exponential moving average per
// T, robust to one-off slow rounds (observe()), interpolated linearly between measured sizes and
// extrapolated past them) and t_draft = the
// drafter's measured time with the draft's checks, top-k / copy back and the choice (the engine's),
// in rounds that follow a drafted round: a call after rounds without drafting (the first of a
// generate call, after the prompt's prefill; the try after a skip run) also feeds the drafter every
// token since its last call (a model drafter's forward over them: 1.6 ms after 32 tokens against
// 0.2 ms after one, embedded draft model on the CPU), which is not what drafting every round costs;
// such a time is used only until the first time from consecutive drafted rounds replaces it.
// The first drafted round verifies up to 2 nodes and the next is a plain step (n = 0), to have
// two sizes measured; every later round measures the size it chose.
// The costs are the target's, so they carry over to the next generate call on the same
// generator; the calibration and the draft time start afresh each call.
//
// When even the best sizes do not repay the drafter's own time (the average over its drafts, an EMA of
// each draft's best expected rate, drafting included, against a plain step's, is more than 5 % under it;
// one unsure draft among sure ones is only verified small), the next rounds are plain steps without
// drafting: 1 round, then 2, 4, ... up to 32 after each further drafted round that does not pay,
// until one does. So a drafter slower than it is worth costs little more than AR. That test is
// hopeful where the calibration has no evidence yet: the draft's top pick at a depth whose band
// has fewer than 8 labelled edges counts as sure there (only there; the size is chosen with the
// calibrated chances), since skipped rounds teach the calibration nothing and an under-confident
// draft would otherwise be given up on at the prior's word.
//
// The choice never changes what is generated (every tree is verified by the target: the output
// is the target's whatever n is), only how fast. A draft in device memory is brought to the host in
// its [d, k] form first (RoundExecutor::device_draft_to_host: the device top-k, one small copy).
#pragma once
#include <cstdint>
#include <vector>

#include "tree.h"

namespace kdtree {

class AdaptiveBudget {
 public:
  static constexpr int kBands = 24;  // calibration bands of path probability: [2^-(b+1), 2^-b), the last open
  static constexpr int64_t kKeepNodes = 1024;  // nodes of a tree kept to learn from (the most likely)

  // A new generate call with trees of up to max_nodes nodes (keeps the measured round costs).
  void reset(int64_t max_nodes);
  // The nodes to verify this round, 0..cap, from the draft's log-probs / ids [d, k] (rows sorted
  // descending, checked) for the root at index `root_index` of the token sequence. The tree is
  // kept until label() can tell which of its nodes the generated text matches.
  // The round must then be given the calibrated rows draft_logprobs() / draft_ids() (the same
  // [d, k] shape) in place of the draft's: its tree of n nodes is the first n of the choice's.
  int64_t choose(const float* logprobs, const int32_t* ids, int64_t d, int64_t k, int64_t cap, int64_t root_index);
  // The last choose()'s draft rows in calibrated order: each log-prob + log(its band's factor),
  // capped at 0, each row re-sorted descending (stable); empty when it chose without a tree.
  const std::vector<float>& draft_logprobs() const { return clp_; }
  const std::vector<int32_t>& draft_ids() const { return cids_; }
  int64_t draft_k() const { return ck_; }
  // Whether this round should not ask the drafter at all (a plain step): after drafted rounds whose
  // best expected rate, drafting included, fell short of a plain step's (see the .cpp).
  bool skip_draft();
  // A round of T = n + 1 tokens took round_seconds (the executor's round) after draft_seconds of
  // drafting (< 0: no draft this round).
  void observe(int64_t n, double round_seconds, double draft_seconds);
  // The token sequence so far, tokens[0, len): labels the depths of the kept trees it has reached
  // and learns from them; a tree it has passed leaves.
  void label(const int32_t* tokens, int64_t len);

  // For tests: the expected cost of a round of T tokens (seconds; 0 when nothing is measured),
  // and the calibration factor of a path probability.
  double round_cost(int64_t T) const;
  double calibration(double path_probability) const;
  int64_t trees_pending() const { return count_; }
  // The drafting seconds the choice counts (0: none measured yet).
  double draft_seconds() const { return draft_seen_ ? draft_s_ : 0.0; }

 private:
  struct Kept {                    // a tree waiting for the text to reach its depths
    int64_t root_index = 0;
    int32_t max_depth = 0;
    int32_t done_depth = 0;                        // depths 1..done_depth labelled
    std::vector<uint8_t> acc;                      // [n+1] node on the generated path (labelled depths)
    std::vector<int32_t> tokens, depths, parents;  // [n], [n], [n+1]
    std::vector<double> prob;                      // [n] probability of the node's edge under the draft
  };
  Tree tree_;
  TreeBuildWorkspace ws_;
  std::vector<double> phat_;   // [n+1] calibrated chance each node of the last tree is accepted (root: 1)
  std::vector<double> popt_;   // [n+1] the same with edges of bands lacking evidence as sure (the skip test)
  std::vector<double> cost_;   // [max+2] EMA of round seconds by T (0 = not measured)
  std::vector<double> curve_;  // [n+2] round_cost(T) for the sizes of the last choose()
  std::vector<float> clp_, key_;                 // [d, k] calibrated rows; scratch: one row's values
  std::vector<int32_t> cids_, corig_;            // [d, k] their ids; each entry's rank in the draft's row
  int64_t ck_ = 0;                               // their k
  std::vector<int64_t> runs_;                    // scratch: a row's sorted runs (their starts, then the end)
  std::vector<int32_t> tmp_;                     // scratch: the runs' merge
  void merge_runs(int32_t* perm, int nruns);
  void calibrate_rows(const float* lp, const int32_t* ids, int64_t d, int64_t k);
  std::vector<Kept> ring_;     // [kTreeMaxDepth] kept trees: count_ of them from head_, oldest first
  int64_t head_ = 0, count_ = 0;
  double cost_between(int64_t T, int64_t lo, int64_t hi, int64_t first) const;
  void fill_curve(int64_t Tmax);
  int64_t skip_len_ = 0, skip_left_ = 0;  // draft skipping: the current run length, rounds left
  double pay_ = 0;                         // the drafts' average worth (EMA of best expected rate x t_round(1))
  bool pay_seen_ = false;
  double band_mass_[kBands] = {}, band_hits_[kBands] = {}, band_count_[kBands] = {};
  double draft_s_ = 0;
  bool draft_seen_ = false;
  bool draft_provisional_ = false;  // draft_s_ is from a call after rounds without drafting
  bool last_drafted_ = false;       // the last observed round asked the drafter
  int64_t max_nodes_ = 0;
};

}  // namespace kdtree

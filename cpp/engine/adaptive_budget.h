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
// factor learned from what the target did, per class of edge and band of q ([2^-(b+1), 2^-b)) with
// exponential forgetting (f = (hits + 0.25) / (mass + 0.25): a prior of a quarter of an edge at the
// draft's word); 1 + sum p_i is the expected tokens emitted (the bonus token always). The classes
// (fifty-ninth session): an edge from a parent on the draft's own chain (the root, or top picks all
// the way) to its row's top pick (chain) or to a lower rank (sibling), and any edge from a parent off
// the chain (off). A draft model's row at depth t is drafted after its own top picks, so the chain's
// edges are what it says they are and the children of a sibling are guesses for another context: on
// the embedded draft model's drafts the chain's top picks at q >= 0.5 were right 1.2 q of the time, the
// top picks under a sibling 0.58 q, and one table for both put the trees' expected tokens ~11 % under
// what they accepted (docs/BENCHMARKS.md "Adaptive tree budget: edge classes and the drafting depth").
// The tree's order uses the chain class's factor for a row's top pick and the sibling class's for
// the rest (a row entry serves every parent at its depth); an off-chain node's chance its own class's. Calibrating
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
// The drafting depth (draft_depth, fifty-ninth session): a draft's time is measured by its rows (a model
// drafter's grows ~0.07 ms a row on the 2-vCPU VM, a Python callback's is mostly per call), and from each
// draft the best tree of its nodes down to each depth e is kept (moving averages of its expected tokens and
// size), so the rate of drafting e rows is known at today's costs; the engine asks the drafter for the
// deepest depth within 10 % of the best rate (the caller's depth is the ceiling; every 16th drafted round
// and every try after a skip run ask for all of it, to keep the deeper depths' figures current).
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
  // The rows to ask the drafter for this round, 1..max_depth (the caller's depth): the depth the recent
  // drafts were worth drafting to, each row at its measured cost (see the .cpp; max_depth until measured).
  int64_t draft_depth(int64_t max_depth);
  // A round of T = n + 1 tokens took round_seconds (the executor's round) after draft_seconds of
  // drafting (< 0: no draft this round) that gave draft_rows rows (0: not known).
  void observe(int64_t n, double round_seconds, double draft_seconds, int64_t draft_rows = 0);
  // The token sequence so far, tokens[0, len): labels the depths of the kept trees it has reached
  // and learns from them; a tree it has passed leaves.
  void label(const int32_t* tokens, int64_t len);

  // Edge classes of the calibration (each its own table of bands): an edge from a parent on the
  // draft's own chain (the root, or a node whose every edge is its row's top pick) to that row's
  // top pick (kChain) or to a lower rank (kSibling), and any edge from a parent off the chain (kOff).
  enum EdgeClass { kChain = 0, kSibling = 1, kOff = 2, kClasses = 3 };
  // For tests: the expected cost of a round of T tokens (seconds; 0 when nothing is measured),
  // and the calibration factor of an edge probability in a class.
  double round_cost(int64_t T) const;
  double calibration(double edge_probability, int edge_class = kChain) const;
  int64_t trees_pending() const { return count_; }
  // The drafting seconds the choice counts (0: none measured yet): a draft's average, and a draft of
  // that many rows (see the .cpp; used where drafts were measured by their rows).
  double draft_seconds() const { return draft_seen_ ? draft_s_ : 0.0; }
  double draft_cost(int64_t rows) const;
  // The expected rate (tokens a second) of drafting e rows, from the drafts seen (0: none yet).
  double depth_rate(int64_t e) const;

 private:
  struct Kept {                    // a tree waiting for the text to reach its depths
    int64_t root_index = 0;
    int32_t max_depth = 0;
    int32_t done_depth = 0;                        // depths 1..done_depth labelled
    std::vector<uint8_t> acc;                      // [n+1] node on the generated path (labelled depths)
    std::vector<int32_t> tokens, depths, parents;  // [n], [n], [n+1]
    std::vector<double> prob;                      // [n] probability of the node's edge under the draft
    std::vector<uint8_t> cls;                      // [n] the edge's class (EdgeClass)
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
  double band_mass_[kClasses][kBands] = {}, band_hits_[kClasses][kBands] = {}, band_count_[kClasses][kBands] = {};
  double logf_[kClasses][kBands] = {};  // log of each band's factor (calibrate_rows; 0 where the factor is 1)
  bool shift_[kClasses][kBands] = {};   // the factor is not 1
  std::vector<uint8_t> chain_;          // [n+1] node on the draft's own chain (root: yes)
  double draft_s_ = 0;
  bool draft_seen_ = false;
  std::vector<double> dcost_;     // [kTreeMaxDepth + 1] a draft's seconds by its rows (moving averages; 0: unmeasured)
  std::vector<double> dg_, dn_;   // [kTreeMaxDepth + 1] by depth limit e: the best trees' gain and size (averages)
  std::vector<uint8_t> dseen_;    // ... seen at least once
  std::vector<uint8_t> dprov_;    // [kTreeMaxDepth + 1] dcost_ from a draft after rounds without drafting
  std::vector<double> dbest_gain_;  // scratch [d+1]: the best depth-limited tree's gain ...
  std::vector<int64_t> dbest_n_;    // ... and size
  int64_t depth_rounds_ = 0;      // draft_depth() calls (every kDepthProbe-th asks for the full depth)
  int64_t asked_ = 0;             // the rows draft_depth() asked for this round (0: not asked)
  std::vector<double> dgain_, dbest_;  // scratch [d+1]: a depth-limited tree's gain, its best rate
  std::vector<int64_t> cnt_;           // ... and its nodes so far
  std::vector<double> rates_;          // scratch [max_depth + 1]: depth_rate of each depth (draft_depth)
  void update_depth(int64_t d, int64_t asked);
  bool draft_provisional_ = false;  // draft_s_ is from a call after rounds without drafting
  bool last_drafted_ = false;       // the last observed round asked the drafter
  int64_t max_nodes_ = 0;
};

}  // namespace kdtree

// adaptive_budget.cpp: see adaptive_budget.h.
#include "engine/adaptive_budget.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kdtree {

namespace {
constexpr double kEma = 0.3;        // weight of a new measurement in the moving averages
constexpr double kEmaDown = 0.5;    // ... of a round cost below the average (noise only ever adds time)
constexpr double kCostClamp = 2.0;  // a round cost counts as at most this many times the size's estimate
constexpr double kForget = 0.99;    // calibration memory: ~100 rounds
constexpr double kPrior = 0.25;     // pseudo probability mass per band, accepted at the draft's word
constexpr int64_t kFirstNodes = 2;  // the first measured tree size (then the plain step)
constexpr double kSkipMargin = 0.05;  // drafting must be expected to cost < 5 % more than it brings
constexpr double kEvidence = 8.0;     // labelled edges a band needs before the skip test believes it
constexpr int64_t kMaxSkip = 32;      // the longest run of rounds without drafting between two tries
constexpr double kPayEma = 0.25;     // weight of a draft's worth in the drafter's average worth (the skip test)
constexpr double kDepthEma = 0.25;    // weight of a draft's best depth-limited tree in that depth's averages
constexpr int64_t kDepthProbe = 16;   // every 16th drafted round drafts the caller's full depth
constexpr double kDepthMargin = 0.10;  // the deepest depth within 10 % of the best expected rate is asked for

int band_of(double p) {
  if (!(p > 0)) return AdaptiveBudget::kBands - 1;
  const int b = static_cast<int>(std::floor(-std::log2(p)));
  return std::clamp(b, 0, AdaptiveBudget::kBands - 1);
}

// The band of a log-prob x, band_of(exp(x)), only grows as x falls: band <= b iff x >= lp_floor()[b].
// The floors are found once by bisection over the float values with that very expression, so the band
// read off them is band_of(exp(x)) exactly, without an exp and a log2 per entry of the draft.
const float* lp_floor() {
  static const std::vector<float> floors = [] {
    std::vector<float> f(AdaptiveBudget::kBands - 1);
    auto band_lp = [](float x) { return band_of(std::exp(static_cast<double>(x))); };
    // order-preserving integer keys of the floats in [-inf, 0]
    auto key = [](float x) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    };
    auto val = [](uint32_t k) {
      uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
      float x;
      std::memcpy(&x, &u, 4);
      return x;
    };
    for (int b = 0; b + 1 < AdaptiveBudget::kBands; ++b) {
      // the smallest x in [-inf, 0] with band_lp(x) <= b (band_lp(0) = 0 <= b; band_lp(-inf) = last > b)
      uint32_t lo = key(-std::numeric_limits<float>::infinity()), hi = key(0.0f);
      while (hi - lo > 1) {  // band_lp(val(lo)) > b, band_lp(val(hi)) <= b
        const uint32_t mid = lo + (hi - lo) / 2;
        if (band_lp(val(mid)) <= b)
          hi = mid;
        else
          lo = mid;
      }
      f[static_cast<size_t>(b)] = val(hi);
    }
    return f;
  }();
  return floors.data();
}

}  // namespace

void AdaptiveBudget::reset(int64_t max_nodes) {
  max_nodes_ = std::max<int64_t>(max_nodes, 0);
  // the round costs are the target's: kept from earlier calls (sizes past the old range unmeasured)
  cost_.resize(static_cast<size_t>(max_nodes_ + 2), 0.0);
  std::fill(&band_mass_[0][0], &band_mass_[0][0] + kClasses * kBands, 0.0);
  std::fill(&band_hits_[0][0], &band_hits_[0][0] + kClasses * kBands, 0.0);
  std::fill(&band_count_[0][0], &band_count_[0][0] + kClasses * kBands, 0.0);
  draft_s_ = 0;
  draft_seen_ = false;
  dcost_.clear();
  dprov_.clear();
  dg_.clear();
  dn_.clear();
  dseen_.clear();
  depth_rounds_ = 0;
  asked_ = 0;
  draft_provisional_ = false;
  last_drafted_ = false;
  tree_.n = 0;
  phat_.assign(1, 1.0);
  head_ = count_ = 0;
  skip_len_ = skip_left_ = 0;
  pay_ = 0;
  pay_seen_ = false;
}

double AdaptiveBudget::round_cost(int64_t T) const {
  const int64_t top = static_cast<int64_t>(cost_.size()) - 1;
  if (T < 1) return 0;
  if (T <= top && cost_[T] > 0) return cost_[T];
  int64_t lo = -1, hi = -1, first = -1;
  for (int64_t t = 1; t <= top; ++t) {
    if (cost_[t] <= 0) continue;
    if (first < 0) first = t;
    if (t < T) lo = t;
    if (t > T && hi < 0) hi = t;
  }
  return cost_between(T, lo, hi, first);
}

// An unmeasured size T from its nearest measured neighbours lo < T < hi (-1: none) and the
// smallest measured size `first`.
double AdaptiveBudget::cost_between(int64_t T, int64_t lo, int64_t hi, int64_t first) const {
  if (lo > 0 && hi > 0) return cost_[lo] + (cost_[hi] - cost_[lo]) * double(T - lo) / double(hi - lo);
  if (lo > 0) {  // past the largest measured size: the slope from the smallest one, else proportional
    if (first < lo) return cost_[lo] + std::max(0.0, (cost_[lo] - cost_[first]) / double(lo - first)) * double(T - lo);
    return cost_[lo] * double(T) / double(lo);
  }
  if (hi > 0) return cost_[hi] * double(T) / double(hi);  // below the smallest: proportional
  return 0;
}

double AdaptiveBudget::calibration(double p, int cls) const {
  const int b = band_of(p), c = std::clamp(cls, 0, kClasses - 1);
  return (band_hits_[c][b] + kPrior) / (band_mass_[c][b] + kPrior);
}

void AdaptiveBudget::calibrate_rows(const float* lp, const int32_t* ids, int64_t d, int64_t k) {
  // Each edge's log-probability raised (or lowered) by its band's calibration, capped at 0, and
  // each row re-sorted descending by it (stable: ties keep the draft's order). A band whose factor is
  // 1 leaves its values as they are (lp + log 1 = lp exactly). Per entry: a band read off the floors
  // (rows are sorted: one forward walk) and an add; a row still sorted after it needs no sort.
  const size_t m = static_cast<size_t>(d * k);
  ck_ = k;
  clp_.resize(m);
  cids_.resize(m);
  corig_.resize(m);
  key_.resize(static_cast<size_t>(k));
  for (int c = 0; c < kClasses; ++c)
    for (int b = 0; b < kBands; ++b) {
      const double f = (band_hits_[c][b] + kPrior) / (band_mass_[c][b] + kPrior);  // = calibration(band, c)
      shift_[c][b] = f != 1.0;
      logf_[c][b] = shift_[c][b] ? std::log(f) : 0.0;
    }
  const float* floor_ = lp_floor();
  runs_.resize(static_cast<size_t>(kBands + 2));  // entry 0's run, one a band, the end
  tmp_.resize(static_cast<size_t>(k));
  for (int64_t r = 0; r < d; ++r) {
    const float* row = lp + r * k;
    int b = 0, nruns = 0;
    bool sorted = true;
    for (int64_t j = 0; j < k; ++j) {
      const float x = row[j];
      const int b0 = b;
      while (b < kBands - 1 && !(x >= floor_[b])) ++b;          // rows descending: bands only grow
      // a band's entries of one class: one sorted run (the top pick, entry 0, is its own: kChain's factor)
      if (j <= 1 || b != b0) runs_[static_cast<size_t>(nruns++)] = j;
      const int c = j == 0 ? kChain : kSibling;
      key_[j] = shift_[c][b] ? static_cast<float>(std::min(0.0, static_cast<double>(x) + logf_[c][b])) : x;
      if (j > 0 && key_[j] > key_[j - 1]) sorted = false;
    }
    runs_[static_cast<size_t>(nruns)] = k;
    int32_t* perm = corig_.data() + r * k;
    for (int64_t j = 0; j < k; ++j) perm[j] = static_cast<int32_t>(j);
    if (!sorted) merge_runs(perm, nruns);
    for (int64_t j = 0; j < k; ++j) {
      clp_[r * k + j] = key_[perm[j]];
      cids_[r * k + j] = ids[r * k + perm[j]];
    }
  }
}

// Sorts perm (the identity over one row) descending by key_, stably, given that [runs_[i], runs_[i+1])
// are nruns runs already sorted (within a band the shift is the same: the order holds): runs merged
// pairwise, ties taken from the left run, until one is left.
void AdaptiveBudget::merge_runs(int32_t* perm, int nruns) {
  int32_t* src = perm;
  int32_t* dst = tmp_.data();
  while (nruns > 1) {
    int out = 0;
    for (int i = 0; i < nruns; i += 2) {
      const int64_t a0 = runs_[static_cast<size_t>(i)];
      const int64_t a1 = runs_[static_cast<size_t>(std::min(i + 1, nruns))];
      const int64_t b1 = runs_[static_cast<size_t>(std::min(i + 2, nruns))];
      int64_t x = a0, y = a1, o = a0;
      while (x < a1 && y < b1) dst[o++] = key_[src[y]] > key_[src[x]] ? src[y++] : src[x++];
      while (x < a1) dst[o++] = src[x++];
      while (y < b1) dst[o++] = src[y++];
      runs_[static_cast<size_t>(out++)] = a0;
    }
    runs_[static_cast<size_t>(out)] = runs_[static_cast<size_t>(nruns)];
    nruns = out;
    std::swap(src, dst);
  }
  if (src != perm) std::copy(src, src + runs_[1], perm);
}

int64_t AdaptiveBudget::choose(const float* lp, const int32_t* ids, int64_t d, int64_t k, int64_t cap,
                               int64_t root_index) {
  cap = std::min(cap, max_nodes_);
  tree_.n = 0;
  clp_.clear();
  cids_.clear();
  if (d <= 0 || cap <= 0) return 0;
  // The tree in the order of the calibrated chances (the rows the round must be given: draft_logprobs /
  // draft_ids), so that its first n nodes are the n most likely to be accepted by what the target did,
  // not by the draft's word (an under-confident chain's nodes would otherwise sit behind siblings the
  // draft rates close to them but the target never takes).
  calibrate_rows(lp, ids, d, k);
  tree_build(clp_.data(), cids_.data(), d, k, cap, &tree_, &ws_);
  const int64_t n = tree_.n, width = std::max<int64_t>(d, 1);
  phat_.resize(static_cast<size_t>(n + 1));
  phat_[0] = 1;
  // keep the tree (its first kKeepNodes nodes) for label()
  // a slot of the ring (its vectors keep their capacity: no allocation once warm); when full, the
  // oldest tree is dropped (a tree waits at most its depth <= kTreeMaxDepth rounds)
  if (ring_.size() < static_cast<size_t>(kTreeMaxDepth)) ring_.resize(static_cast<size_t>(kTreeMaxDepth));
  if (count_ == kTreeMaxDepth) {
    head_ = (head_ + 1) % kTreeMaxDepth;
    --count_;
  }
  Kept& kept = ring_[static_cast<size_t>((head_ + count_) % kTreeMaxDepth)];
  ++count_;
  const int64_t nk = std::min<int64_t>(n, kKeepNodes);
  kept.root_index = root_index;
  kept.tokens.assign(tree_.tokens.begin(), tree_.tokens.begin() + nk);
  kept.depths.assign(tree_.depths.begin(), tree_.depths.begin() + nk);
  kept.parents.assign(tree_.parents.begin(), tree_.parents.begin() + nk + 1);
  kept.prob.resize(static_cast<size_t>(nk));
  kept.cls.resize(static_cast<size_t>(nk));
  kept.acc.assign(static_cast<size_t>(nk + 1), 0);
  kept.acc[0] = 1;
  kept.max_depth = kept.done_depth = 0;

  // the drafting this round cost: by its rows where drafts are measured by their rows, else the average draft
  const double by_rows = draft_cost(d);
  const double draft = by_rows > 0 ? by_rows : draft_seen_ ? draft_s_ : 0.0;
  const bool larger_known = std::any_of(cost_.begin() + 2, cost_.end(), [](double c) { return c > 0; });
  const bool ends_known = cost_[1] > 0 && larger_known;
  if (ends_known) fill_curve(n + 1);
  double gain = 1.0, best = ends_known ? 1.0 / (draft + curve_[1]) : 0.0;
  // The skip test's hopeful twin: a chain edge (the draft's top pick under its own top picks) whose band
  // has fewer than kEvidence labelled chain edges counts as sure (its parent's chance), so drafting is not given up on
  // before the calibration has seen what the draft's probabilities are worth (an under-confident
  // draft, right at q = 0.12, looks poor at the prior's word, and skipped rounds teach nothing).
  // Only the chain's top picks: the siblings, many and rarely labelled, would otherwise each count their
  // parent's chance for good.
  popt_.resize(static_cast<size_t>(n + 1));
  popt_[0] = 1;
  chain_.resize(static_cast<size_t>(n + 1));
  chain_[0] = 1;
  double gain_opt = 1.0, best_opt = best;
  int64_t best_n = 0;
  for (int64_t i = 1; i <= n; ++i) {
    const int32_t dep = tree_.depths[i - 1];
    const int32_t rank = ws_.rank_paths[i * width + dep - 1];            // in the calibrated row
    const int32_t orig = corig_[static_cast<size_t>((dep - 1) * k + rank)];  // ... and in the draft's
    const double p = std::exp(static_cast<double>(lp[(dep - 1) * k + orig]));  // the draft's probability of the edge
    // The edge's class: its parent on the draft's own chain or not, its rank the draft's top pick or not.
    // Chain and sibling edges take the calibrated row's value (the tree's order); an edge from a parent
    // off the chain its own class's factor (a drafter whose rows follow its own top picks, like a draft
    // model, is right about their children far less often: the row was not drafted for that parent).
    const int32_t par = tree_.parents[i];
    const bool on = chain_[static_cast<size_t>(par)] != 0;
    const int cls = !on ? kOff : orig == 0 ? kChain : kSibling;
    chain_[static_cast<size_t>(i)] = on && orig == 0;
    double edge = std::exp(static_cast<double>(clp_[static_cast<size_t>((dep - 1) * k + rank)]));  // calibrated
    if (cls == kOff) {
      const int b = band_of(p);
      const float x = lp[(dep - 1) * k + orig];
      edge = std::exp(shift_[kOff][b] ? static_cast<double>(static_cast<float>(std::min(0.0, static_cast<double>(x) + logf_[kOff][b])))
                                      : static_cast<double>(x));
    }
    phat_[i] = phat_[par] * edge;
    const bool hopeful = cls == kChain && band_count_[kChain][band_of(p)] < kEvidence;  // the draft's own pick, unjudged
    popt_[i] = popt_[par] * (hopeful ? 1.0 : edge);
    if (i <= nk) {
      kept.prob[i - 1] = p;
      kept.cls[i - 1] = static_cast<uint8_t>(cls);
      kept.max_depth = std::max(kept.max_depth, dep);
    }
    if (!ends_known) continue;
    gain += phat_[i];
    gain_opt += popt_[i];
    const double rate = gain / (draft + curve_[i + 1]);
    if (rate > best) {
      best = rate;
      best_n = i;
    }
    best_opt = std::max(best_opt, gain_opt / (draft + curve_[i + 1]));
  }
  // Two sizes measured first: a small tree (up to kFirstNodes nodes), then a plain step; other
  // sizes are interpolated / extrapolated from what is measured until they are chosen.
  const int64_t asked = asked_ > 0 ? asked_ : d;
  asked_ = 0;
  if (!ends_known) return larger_known ? 0 : std::min(n, kFirstNodes);
  if (by_rows > 0) update_depth(d, asked);
  // Did drafting pay? Each draft's worth is its best expected rate (its hopeful twin: the draft's top picks in
  // bands without evidence count as sure) over a plain step's (1 / t_round(1)), and the drafter's worth the
  // average of its drafts' (an EMA, from the first draft whose drafting time is known). If that is short by
  // more than the margin, the next rounds skip the drafter: 1, then 2, 4, ... (up to kMaxSkip) after each
  // further drafted round (a try) whose own draft does not pay; a try that pays ends the skipping. One draft
  // alone used to decide (before the fifty-sixth session): with a drafter whose confidence swings from draft to
  // draft (the embedded draft model: top-1 chances 0.13-0.99) every unsure draft started a skip run, although
  // the next draft was as likely sure; an unsure draft is verified small or not at all anyway (best_n).
  const double worth = best_opt * curve_[1];
  if (draft_seen_) {  // (before the drafter's time is known a draft's worth says nothing about it)
    pay_ = pay_seen_ ? (1 - kPayEma) * pay_ + kPayEma * worth : worth;
    pay_seen_ = true;
  }
  const double judged = skip_len_ > 0 || !pay_seen_ ? worth : pay_;
  if (judged < 1.0 - kSkipMargin) {
    skip_len_ = skip_len_ > 0 ? std::min<int64_t>(2 * skip_len_, kMaxSkip) : 1;
    skip_left_ = skip_len_;
  } else {
    if (skip_len_ > 0) pay_ = std::max(pay_, worth);  // (a try that pays: the average starts from it)
    skip_len_ = 0;
  }
  return best_n;
}

// The depth worth drafting to. From each draft, for every depth limit e the best tree of the draft's
// nodes of depth <= e (in the tree's order: a prefix of them is the best-first tree of the depth-limited
// draft) by expected rate, e rows of drafting counted at their measured cost (draft_cost): its expected
// tokens and its size; for e past the rows the drafter gave when it was asked for more (it stopped itself:
// a model drafter's chain-probability stop) those of its last row (it would stop there again). Each depth
// keeps moving averages of the two, and depth_rate(e) is their rate at today's draft and round costs;
// draft_depth() asks for the deepest depth within kDepthMargin of the best rate. Every kDepthProbe-th
// drafted round asks for the caller's full depth, so that the deeper rows' averages are brought up to date
// (and the depth can grow again), and so does a try after a skip run.
void AdaptiveBudget::update_depth(int64_t d, int64_t asked) {
  const int64_t n = tree_.n, top = std::min<int64_t>(std::max(d, asked), kTreeMaxDepth);
  dgain_.assign(static_cast<size_t>(top + 1), 1.0);
  dbest_.assign(static_cast<size_t>(top + 1), 0.0);
  dbest_gain_.assign(static_cast<size_t>(top + 1), 1.0);
  dbest_n_.assign(static_cast<size_t>(top + 1), 0);
  cnt_.assign(static_cast<size_t>(top + 1), 0);
  for (int64_t e = 1; e <= d; ++e) dbest_[e] = 1.0 / (draft_cost(e) + curve_[1]);  // (n = 0)
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t dep = tree_.depths[i - 1];
    for (int64_t e = dep; e <= d; ++e) {
      dgain_[e] += phat_[i];
      const int64_t m = ++cnt_[e];
      const double r = dgain_[e] / (draft_cost(e) + curve_[m + 1]);
      if (r > dbest_[e]) {
        dbest_[e] = r;
        dbest_gain_[e] = dgain_[e];
        dbest_n_[e] = m;
      }
    }
  }
  if (dg_.size() < static_cast<size_t>(kTreeMaxDepth + 1)) {
    dg_.assign(static_cast<size_t>(kTreeMaxDepth + 1), 0.0);
    dn_.assign(static_cast<size_t>(kTreeMaxDepth + 1), 0.0);
    dseen_.assign(static_cast<size_t>(kTreeMaxDepth + 1), 0);
  }
  for (int64_t e = 1; e <= top; ++e) {
    const int64_t f = std::min(e, d);
    const double g = dbest_gain_[f], m = static_cast<double>(dbest_n_[f]);
    dg_[e] = dseen_[e] ? (1 - kDepthEma) * dg_[e] + kDepthEma * g : g;
    dn_[e] = dseen_[e] ? (1 - kDepthEma) * dn_[e] + kDepthEma * m : m;
    dseen_[e] = 1;
  }
}

// The expected rate of drafting e rows: its best trees' average gain over the average draft and round
// costs (the costs of now, not of when the trees were seen).
double AdaptiveBudget::depth_rate(int64_t e) const {
  if (e < 1 || e >= static_cast<int64_t>(dseen_.size()) || !dseen_[e]) return 0.0;
  const double m = dn_[e];
  const int64_t m0 = static_cast<int64_t>(m);
  const double c = round_cost(m0 + 1) + (m - static_cast<double>(m0)) * (round_cost(m0 + 2) - round_cost(m0 + 1));
  const double t = draft_cost(e) + c;
  return t > 0 ? dg_[e] / t : 0.0;
}

// A draft of e rows: measured, else linear between the measured row counts around it, else extrapolated
// from the two nearest (slope >= 0, never below 0), else proportional to the one measured count (a guess
// that favours trying another depth, which then measures it: a drafter whose time is per call, not per
// row, shows it after one such try).
double AdaptiveBudget::draft_cost(int64_t e) const {
  if (dcost_.empty() || e < 1) return 0.0;
  const int64_t top = static_cast<int64_t>(dcost_.size()) - 1;
  if (e <= top && dcost_[e] > 0) return dcost_[e];
  int64_t lo = -1, lo2 = -1, hi = -1, hi2 = -1;
  for (int64_t t = 1; t <= top; ++t) {
    if (dcost_[t] <= 0) continue;
    if (t < e) {
      lo2 = lo;
      lo = t;
    } else if (hi < 0) {
      hi = t;
    } else if (hi2 < 0) {
      hi2 = t;
    }
  }
  auto line = [&](int64_t a, int64_t b) {  // through the counts a < b, at e (slope >= 0, value >= 0)
    const double slope = std::max(0.0, (dcost_[b] - dcost_[a]) / static_cast<double>(b - a));
    return std::max(0.0, dcost_[a] + slope * static_cast<double>(e - a));
  };
  if (lo > 0 && hi > 0) return line(lo, hi);
  if (hi > 0) return hi2 > 0 ? line(hi, hi2) : dcost_[hi] * static_cast<double>(e) / static_cast<double>(hi);
  if (lo > 0) return lo2 > 0 ? line(lo2, lo) : dcost_[lo] * static_cast<double>(e) / static_cast<double>(lo);
  return 0.0;
}

int64_t AdaptiveBudget::draft_depth(int64_t max_depth) {
  max_depth = std::clamp<int64_t>(max_depth, 1, kTreeMaxDepth);
  asked_ = max_depth;
  // (a try after a skip run drafts the full depth too: it judges the drafter on all it can give)
  if (!dseen_.empty() && skip_len_ == 0 && ++depth_rounds_ % kDepthProbe != 0) {
    rates_.resize(static_cast<size_t>(max_depth + 1));
    double best_rate = 0.0;
    for (int64_t e = 1; e <= max_depth; ++e) best_rate = std::max(best_rate, rates_[e] = depth_rate(e));
    // the deepest depth within kDepthMargin of the best rate (a row more is cheap insurance where the
    // rates are that close: an n-gram drafter's rare long matches are what it is worth)
    int64_t best = 0;
    for (int64_t e = 1; e <= max_depth; ++e)
      if (best_rate > 0 && rates_[e] >= (1 - kDepthMargin) * best_rate) best = e;
    if (best > 0) asked_ = best;
  }
  return asked_;
}

bool AdaptiveBudget::skip_draft() {
  if (skip_left_ <= 0) return false;
  --skip_left_;
  return true;
}

void AdaptiveBudget::fill_curve(int64_t Tmax) {
  // round_cost(T) for T = 1 .. Tmax in one pass over the measured sizes (not one scan per T: the
  // choice reads every size of a tree of up to B nodes each round)
  curve_.assign(static_cast<size_t>(Tmax + 1), 0.0);
  const int64_t top = static_cast<int64_t>(cost_.size()) - 1;
  int64_t first = -1, lo = -1, next = 1;  // next: the first measured size >= T (top + 1: none)
  auto advance = [&](int64_t from) {
    int64_t t = from;
    while (t <= top && cost_[t] <= 0) ++t;
    return t;
  };
  next = advance(1);
  first = next <= top ? next : -1;
  for (int64_t T = 1; T <= Tmax; ++T) {
    if (next < T) {
      lo = next;
      next = advance(next + 1);
    }
    if (next == T) {
      curve_[T] = cost_[T];
      continue;
    }
    curve_[T] = cost_between(T, lo, next <= top ? next : -1, first);
  }
}

void AdaptiveBudget::observe(int64_t n, double round_seconds, double draft_seconds, int64_t draft_rows) {
  const int64_t T = n + 1;
  if (T < static_cast<int64_t>(cost_.size()) && round_seconds > 0) {
    // Robust to one-off slow rounds (a CUDA model runs a new window size eagerly, then captures its
    // graph at the second use: ~10x a replay; host jitter): a round counts as at most kCostClamp
    // times the size's estimate (measured, else from its measured neighbours), and a faster round
    // weighs more than a slower one. A lasting change still gets in (+30 % a round at most).
    const double ref = round_cost(T);
    const double x = ref > 0 ? std::min(round_seconds, kCostClamp * ref) : round_seconds;
    const double old = cost_[T];
    cost_[T] = old > 0 ? old + (x < old ? kEmaDown : kEma) * (x - old) : x;
  }
  if (draft_seconds >= 0) {
    // A call after rounds without drafting (the generate's first, a try after a skip run) also fed
    // the drafter the tokens since its last call: kept only until consecutive rounds measure one.
    if (dcost_.empty()) {
      dcost_.assign(static_cast<size_t>(kTreeMaxDepth + 1), 0.0);
      dprov_.assign(static_cast<size_t>(kTreeMaxDepth + 1), 0);
    }
    const bool rows_ok = draft_rows > 0 && draft_rows <= kTreeMaxDepth;
    if (!last_drafted_) {
      if (!draft_seen_) {
        draft_s_ = draft_seconds;
        draft_seen_ = draft_provisional_ = true;
      }
      if (rows_ok && dcost_[draft_rows] <= 0) {  // a row count's first time, kept until a consecutive one
        dcost_[draft_rows] = draft_seconds;
        dprov_[draft_rows] = 1;
      }
    } else {
      if (!draft_seen_ || draft_provisional_) {
        draft_s_ = draft_seconds;
        draft_seen_ = true;
        draft_provisional_ = false;
      } else {
        draft_s_ = (1 - kEma) * draft_s_ + kEma * draft_seconds;
      }
      // the draft's time by its rows (the same rule: a time after rounds without drafting only where
      // nothing else is known, replaced by the first from consecutive drafted rounds)
      if (rows_ok) {
        double& c = dcost_[static_cast<size_t>(draft_rows)];
        c = c > 0 && !dprov_[draft_rows] ? (1 - kEma) * c + kEma * draft_seconds : draft_seconds;
        dprov_[draft_rows] = 0;
      }
    }
  }
  last_drafted_ = draft_seconds >= 0;
}

void AdaptiveBudget::label(const int32_t* tokens, int64_t len) {
  // Depth by depth: a kept tree's nodes at depth t are labelled once the text has its token at
  // root + t (the text is what the target took, whichever tree was verified), not when it has passed
  // the whole tree, so the calibration hears of a draft after one round, not after up to its depth.
  for (int64_t c = 0; c < count_; ++c) {
    Kept& t = ring_[static_cast<size_t>((head_ + c) % kTreeMaxDepth)];
    const int64_t upto = std::min<int64_t>(len - 1 - t.root_index, t.max_depth);
    if (upto <= t.done_depth) continue;
    if (t.done_depth == 0)  // a tree's first labels: the memory forgets a step (once per tree)
      for (int c = 0; c < kClasses; ++c)
        for (int b = 0; b < kBands; ++b) {
          band_mass_[c][b] *= kForget;
          band_hits_[c][b] *= kForget;
          band_count_[c][b] *= kForget;
        }
    // node i matches iff its parent does and its token is the text's token at its depth (a parent
    // precedes its children in the tree, and sits at a smaller depth: labelled before them)
    const int64_t n = static_cast<int64_t>(t.tokens.size());
    for (int64_t i = 1; i <= n; ++i) {
      const int32_t dep = t.depths[i - 1];
      if (dep <= t.done_depth || dep > upto || !t.acc[t.parents[i]]) continue;  // learned where its parent matched
      t.acc[i] = t.tokens[i - 1] == tokens[t.root_index + dep];
      const int b = band_of(t.prob[i - 1]), c = t.cls[i - 1];
      band_mass_[c][b] += t.prob[i - 1];
      band_hits_[c][b] += t.acc[i];
      band_count_[c][b] += 1;
    }
    t.done_depth = static_cast<int32_t>(upto);
  }
  // trees the text has passed leave (oldest first; trees are kept in root order)
  while (count_ > 0 && ring_[static_cast<size_t>(head_)].done_depth >= ring_[static_cast<size_t>(head_)].max_depth) {
    head_ = (head_ + 1) % kTreeMaxDepth;
    --count_;
  }
}

}  // namespace kdtree

#include "engine/ngram_drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common.h"

namespace kdtree {

void check_ngram_params(const NgramParams& p) {
  if (p.min_ngram < 1 || p.min_ngram > p.max_ngram)
    throw Error("NgramDrafter: need 1 <= min_ngram <= max_ngram, got min_ngram=" + std::to_string(p.min_ngram) +
                ", max_ngram=" + std::to_string(p.max_ngram));
  if (p.max_matches < 1) throw Error("NgramDrafter: max_matches must be >= 1, got " + std::to_string(p.max_matches));
}

NgramDrafter::NgramDrafter(const NgramParams& p) : p_(p) { check_ngram_params(p_); }

void NgramDrafter::draft(const int32_t* ctx, int64_t n, int64_t depth, int64_t top_k, DraftOutput& out) {
  out.clear();
  if (depth <= 0 || top_k <= 0 || n < 2) return;
  // ends e in [0, n - 2] whose window of ng tokens ending at e equals the context's last ng,
  // narrowed one length at a time (a match of ng + 1 tokens is also one of ng)
  ends_.clear();
  starts_.clear();
  weights_.clear();
  for (int64_t e = 0; e < n - 1; ++e)
    if (ctx[e] == ctx[n - 1]) ends_.push_back(e);
  const int64_t top_ng = std::min(p_.max_ngram, n - 1);
  for (int64_t ng = 1; ng <= top_ng; ++ng) {
    if (ng > 1) {
      size_t w = 0;
      for (int64_t e : ends_)
        if (e >= ng - 1 && ctx[e - (ng - 1)] == ctx[n - ng]) ends_[w++] = e;
      ends_.resize(w);
    }
    if (ends_.empty()) break;
    if (ng >= p_.min_ngram) {
      const size_t take = std::min<size_t>(ends_.size(), static_cast<size_t>(p_.max_matches));
      for (size_t i = ends_.size() - take; i < ends_.size(); ++i) {  // the most recent occurrences
        starts_.push_back(ends_[i] + 1);
        weights_.push_back(ng);
      }
    }
  }
  if (starts_.empty()) return;
  const int64_t d = std::min(depth, n - *std::min_element(starts_.begin(), starts_.end()));
  // (depth, token, weight) of every continuation, summed per (depth, token)
  entries_.clear();
  for (size_t i = 0; i < starts_.size(); ++i)
    for (int64_t j = 0; j < d && starts_[i] + j < n; ++j) entries_.push_back({j, ctx[starts_[i] + j], weights_[i]});
  std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) {
    return a.depth != b.depth ? a.depth < b.depth : a.token < b.token;
  });
  size_t w = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (w > 0 && entries_[w - 1].depth == entries_[i].depth && entries_[w - 1].token == entries_[i].token)
      entries_[w - 1].weight += entries_[i].weight;
    else
      entries_[w++] = entries_[i];
  }
  entries_.resize(w);
  // each depth's tokens by (-weight, token); k = the most distinct tokens of a depth, capped at top_k
  std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) {
    if (a.depth != b.depth) return a.depth < b.depth;
    if (a.weight != b.weight) return a.weight > b.weight;
    return a.token < b.token;
  });
  std::vector<int64_t>& first = first_;  // entries of depth j: [first[j], first[j + 1])
  first.assign(static_cast<size_t>(d) + 1, 0);
  for (const Entry& e : entries_) ++first[static_cast<size_t>(e.depth) + 1];
  int64_t widest = 0;
  for (int64_t j = 0; j < d; ++j) {
    widest = std::max(widest, first[j + 1]);
    first[j + 1] += first[j];
  }
  const int64_t k = std::min(top_k, widest);
  out.d = d;
  out.k = k;
  out.values.assign(static_cast<size_t>(d * k), -std::numeric_limits<float>::infinity());
  out.ids.assign(static_cast<size_t>(d * k), 0);
  for (int64_t j = 0; j < d; ++j) {
    double total = 0.0;  // exact: a sum of small integers
    for (int64_t i = first[j]; i < first[j + 1]; ++i) total += static_cast<double>(entries_[i].weight);
    for (int64_t r = 0; r < k && first[j] + r < first[j + 1]; ++r) {
      const Entry& e = entries_[first[j] + r];
      out.values[j * k + r] = static_cast<float>(std::log(static_cast<double>(e.weight) / total));
      out.ids[j * k + r] = e.token;
    }
  }
}

}  // namespace kdtree

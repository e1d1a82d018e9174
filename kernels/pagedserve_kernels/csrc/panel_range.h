// Work that threads split evenly and then take from each other: each thread owns a range of items
// (output panels of a multiply, runs of attention rows), takes its own from the front, in order, and,
// done with them, takes another thread's from the back, one at a time. A thread that the OS takes off
// its core in the middle of a part (the server's event loop, the load generator, any other process on
// a busy machine) then holds the others up by the item it is in, not by the rest of its share
// (bench/README.md, "a decode step's threads take each other's panels"). Taking from the two ends keeps
// each thread's own items in order, so that it can prefetch the next one; a shared counter would
// interleave them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace pagedserve {

// [begin, end) of part `part` of `parts` of [0, n), as at::parallel_for splits a range.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t part, int64_t parts) {
  const int64_t chunk = (n + parts - 1) / parts;
  return {std::min(n, part * chunk), std::min(n, (part + 1) * chunk)};
}

// The items of one thread's share that nobody has taken yet, [front, back) in one word.
struct alignas(64) PanelRange {
  std::atomic<uint64_t> bounds{0};

  void set(int64_t front, int64_t back) {
    bounds.store(static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32), std::memory_order_relaxed);
  }
};

// `num_shares` ranges over [0, n), as at::parallel_for would split it over that many threads.
inline std::unique_ptr<PanelRange[]> even_shares(int64_t n, int64_t num_shares) {
  std::unique_ptr<PanelRange[]> shares(new PanelRange[num_shares]);
  for (int64_t s = 0; s < num_shares; ++s) {
    const auto [item0, item1] = share(n, s, num_shares);
    shares[s].set(item0, item1);
  }
  return shares;
}

// Take the front item of `range` into `item`, or (`from_back`) its back one: false when none is left.
// `more`: items are left beside the one taken.
inline bool take_panel(PanelRange& range, bool from_back, int64_t& item, bool& more) {
  uint64_t bounds = range.bounds.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = bounds & 0xffffffffu, back = bounds >> 32;
    if (front >= back) return false;
    const uint64_t left = from_back ? front | ((back - 1) << 32) : (front + 1) | (back << 32);
    if (range.bounds.compare_exchange_weak(bounds, left, std::memory_order_relaxed)) {
      item = static_cast<int64_t>(from_back ? back - 1 : front);
      more = front + 1 < back;
      return true;
    }
  }
}

// Every item of `shares` ranges, for the thread that owns share `own`: its own from the front
// (own(item, more): `more`, it takes the next of its own after this one), then the others' from the
// back (stolen(item)). Every thread of the region calls it with its own share; an item is run once.
template <typename Own, typename Stolen>
void take_share_then_steal(PanelRange* shares, int64_t num_shares, int64_t own, const Own& run_own,
                           const Stolen& run_stolen) {
  int64_t item;
  bool more;
  while (take_panel(shares[own], false, item, more)) run_own(item, more);
  for (int64_t other = 1; other < num_shares; ++other) {
    while (take_panel(shares[(own + other) % num_shares], true, item, more)) run_stolen(item);
  }
}

}  // namespace pagedserve

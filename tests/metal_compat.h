// Metal Shading Language compatibility layer: runs kernel bodies written for
// mx.fast.metal_kernel on a CPU (driven by tests/metal_harness.py).
//
// Each threadgroup runs as cooperative fibers (ucontext), one per thread. A
// thread runs until it reaches a barrier or a SIMD-group operation (simd_sum,
// simd_shuffle, ...) and waits there. The order in which threads run between
// those points is chosen per run (harness::Order: in index order, reversed, or
// a seeded random permutation re-drawn at every pass; threadgroups likewise),
// so a kernel that reads another thread's result without a barrier gives a
// different answer under some order.
// SIMD-group operations follow the GPU's execution model: when every live
// lane of a SIMD group is waiting, the lanes waiting at the same operation
// (same source line, same visit count) are the active lanes and take part;
// lanes elsewhere (another branch, a barrier, returned) are inactive. A sum
// covers the active lanes only; reading an inactive or missing lane (shuffle)
// gives all-ones bits (NaN), as undefined on the GPU. A threadgroup barrier
// must be reached by every live thread at the same line (else: error).
// `threadgroup` variables are statics, shared by the fibers of the running group.
#pragma once
// macOS: <ucontext.h> refuses to compile without _XOPEN_SOURCE (and without it
// ucontext_t has the wrong size on arm64); _DARWIN_C_SOURCE keeps the rest of
// the C library visible. Both must precede the first system header.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE 1
#endif
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <algorithm>
#include <map>
#include <random>
#include <vector>

#define device
#define constant
#define thread
#define threadgroup static
#define kernel
#define METAL_FUNC inline

typedef unsigned int uint;
typedef unsigned short ushort;
typedef _Float16 half;

struct bfloat {
  uint16_t bits;
  bfloat() : bits(0) {}
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;  // NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      bits = uint16_t(u >> 16);
    }
  }
  bfloat(double d) : bfloat(float(d)) {}
  bfloat(int i) : bfloat(float(i)) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat bfloat16_t;

template <typename T>
struct vec3 {
  T x, y, z;
};
typedef vec3<uint> uint3;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

namespace metal {
using std::abs;
using std::ceil;
using std::cos;
using std::exp;
using std::exp2;
using std::floor;
using std::fma;
using std::log;
using std::log2;
using std::max;
using std::min;
using std::pow;
using std::sin;
using std::sqrt;
using std::tanh;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace fast {
using std::exp;
using std::log;
using std::sqrt;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace fast
namespace precise {
using std::exp;
using std::log;
using std::sqrt;
}  // namespace precise
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
}  // namespace metal
using namespace metal;

// ---- the cooperative scheduler --------------------------------------------------
namespace harness {

struct Thread {  // what a kernel thread sees
  uint3 pos, local, group, tg, groups;
  uint linear;
};

enum class State { runnable, simd, barrier, done };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Thread t;
  State state = State::runnable;
  long site = 0, visit = 0;       // where it waits: source line, and how many times it came there
  std::map<long, long> visits;
  uint64_t value = 0;             // its operand at a SIMD operation
  uint64_t lanes[32];             // the operands of all lanes after the operation
  bool active[32];
};

struct Order {  // in which order runnable threads, threadgroups and divergent branches go
  int mode = 0;  // 0: index order, 1: reversed, 2: random
  std::mt19937 rng{0};
  template <typename V>
  void arrange(V& v) {
    if (mode == 1) std::reverse(v.begin(), v.end());
    if (mode == 2) std::shuffle(v.begin(), v.end(), rng);
  }
};

inline Order& order() {
  static Order o;
  return o;
}

struct Group {
  std::vector<Fiber> fibers;
  ucontext_t sched;
  int current = 0, n = 0;  // fibers[0..n) are the running group's threads (stacks reused)
  void (*body)(const Thread&) = nullptr;
};

inline Group*& group() {
  static Group* g = nullptr;
  return g;
}
inline Fiber& self() { return group()->fibers[group()->current]; }

inline void park(State s, long line, uint64_t value) {
  Group* g = group();
  Fiber& f = g->fibers[g->current];
  f.state = s;
  f.site = line;
  f.visit = ++f.visits[line];
  f.value = value;
  swapcontext(&f.ctx, &g->sched);
}

inline void trampoline(int idx) {
  Group* g = group();
  Fiber& f = g->fibers[idx];
  g->body(f.t);
  f.state = State::done;
  swapcontext(&f.ctx, &g->sched);
}

// Nothing can run: complete one SIMD operation per SIMD group, or the barrier.
inline void resolve(Group& g) {
  std::map<uint, std::vector<int>> simd;  // SIMD group -> its waiting lanes
  std::vector<int> live;
  for (int i = 0; i < g.n; ++i) {
    const Fiber& f = g.fibers[i];
    if (f.state == State::done) continue;
    live.push_back(i);
    if (f.state == State::simd) simd[f.t.linear / 32].push_back(i);
  }
  if (!simd.empty()) {
    for (auto& kv : simd) {
      // The distinct operations this SIMD group's lanes wait at (divergent branches).
      std::vector<std::pair<long, long>> ops;
      for (int i : kv.second) {
        std::pair<long, long> op(g.fibers[i].site, g.fibers[i].visit);
        if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
      }
      std::sort(ops.begin(), ops.end());
      order().arrange(ops);
      const std::pair<long, long> op = ops[0];
      uint64_t vals[32];
      bool active[32];
      for (int l = 0; l < 32; ++l) {
        vals[l] = ~uint64_t(0);
        active[l] = false;
      }
      for (int i : kv.second) {
        const Fiber& f = g.fibers[i];
        if (f.site == op.first && f.visit == op.second) {
          vals[f.t.linear % 32] = f.value;
          active[f.t.linear % 32] = true;
        }
      }
      for (int i : kv.second) {
        Fiber& f = g.fibers[i];
        if (f.site == op.first && f.visit == op.second) {
          std::memcpy(f.lanes, vals, sizeof vals);
          std::memcpy(f.active, active, sizeof active);
          f.state = State::runnable;
        }
      }
    }
    return;
  }
  for (int i : live) {
    if (g.fibers[i].site != g.fibers[live[0]].site || g.fibers[i].visit != g.fibers[live[0]].visit) {
      std::fprintf(stderr, "harness: threads of a threadgroup wait at different barriers (lines %ld and %ld)\n",
                   g.fibers[live[0]].site, g.fibers[i].site);
      std::exit(3);
    }
  }
  for (int i : live) g.fibers[i].state = State::runnable;
}

inline void run_group(Group& g, uint3 grid, uint3 tg, uint3 gpos, uint3 groups) {
  const uint per = tg.x * tg.y * tg.z;
  if (per > 1024) {
    std::fprintf(stderr, "harness: threadgroup of %u threads (Metal allows 1024)\n", per);
    std::exit(4);
  }
  if (g.fibers.size() < per) g.fibers.resize(per);
  int n = 0;
  for (uint z = 0; z < tg.z; ++z)
    for (uint y = 0; y < tg.y; ++y)
      for (uint x = 0; x < tg.x; ++x) {
        uint3 pos = {gpos.x * tg.x + x, gpos.y * tg.y + y, gpos.z * tg.z + z};
        if (pos.x >= grid.x || pos.y >= grid.y || pos.z >= grid.z) continue;  // non-uniform edge group
        Fiber& f = g.fibers[n];
        f.t = {pos, {x, y, z}, gpos, tg, groups, x + y * tg.x + z * tg.x * tg.y};
        f.state = State::runnable;
        f.visits.clear();
        if (f.stack.empty()) f.stack.resize(1 << 18);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, (void (*)())trampoline, 1, n);
        n++;
      }
  g.n = n;
  std::vector<int> idx(n);
  for (int i = 0; i < n; ++i) idx[i] = i;
  for (;;) {
    bool ran = false, all_done = true;
    std::vector<int> pass = idx;
    order().arrange(pass);
    for (int i : pass) {
      if (g.fibers[i].state != State::done) all_done = false;
      if (g.fibers[i].state != State::runnable) continue;
      ran = true;
      g.current = i;
      swapcontext(&g.sched, &g.fibers[i].ctx);
    }
    if (all_done) break;
    if (!ran) resolve(g);
  }
}

inline void dispatch(uint3 grid, uint3 tg, void (*body)(const Thread&)) {
  uint3 groups = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  std::vector<uint3> all;
  for (uint z = 0; z < groups.z; ++z)
    for (uint y = 0; y < groups.y; ++y)
      for (uint x = 0; x < groups.x; ++x) all.push_back({x, y, z});
  order().arrange(all);
  Group g;
  g.body = body;
  group() = &g;
  for (const uint3& gpos : all) run_group(g, grid, tg, gpos, groups);
  group() = nullptr;
}

template <typename T>
uint64_t pack(T v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
T unpack(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace harness

// ---- barriers and SIMD-group functions ---------------------------------------------
inline void threadgroup_barrier(metal::mem_flags = metal::mem_flags::mem_none, long line = __builtin_LINE()) {
  harness::park(harness::State::barrier, line, 0);
}
inline void simdgroup_barrier(metal::mem_flags = metal::mem_flags::mem_none, long line = __builtin_LINE()) {
  harness::park(harness::State::simd, line, 0);
}

// Every lane's operand once the active lanes of this SIMD group met there.
template <typename T>
struct Lanes {
  T v[32];
  bool live[32];
};
template <typename T>
inline Lanes<T> simd_values(T x, long line) {
  harness::park(harness::State::simd, line, harness::pack(x));
  const harness::Fiber& f = harness::self();
  Lanes<T> out;
  for (int i = 0; i < 32; ++i) {
    out.live[i] = f.active[i];
    out.v[i] = harness::unpack<T>(f.active[i] ? f.lanes[i] : ~uint64_t(0));
  }
  return out;
}

template <typename T>
inline T simd_sum(T x, long line = __builtin_LINE()) {
  auto l = simd_values(x, line);
  T v[32];
  for (int i = 0; i < 32; ++i) v[i] = l.live[i] ? l.v[i] : T(0);
  for (int w = 1; w < 32; w *= 2)  // pairwise (tree) order, as SIMD reductions combine lanes
    for (int i = 0; i + w < 32; i += 2 * w) v[i] = T(v[i] + v[i + w]);
  return v[0];
}
template <typename T>
inline T simd_max(T x, long line = __builtin_LINE()) {
  auto l = simd_values(x, line);
  T m = x;
  for (int i = 0; i < 32; ++i)
    if (l.live[i] && l.v[i] > m) m = l.v[i];
  return m;
}
template <typename T>
inline T simd_min(T x, long line = __builtin_LINE()) {
  auto l = simd_values(x, line);
  T m = x;
  for (int i = 0; i < 32; ++i)
    if (l.live[i] && l.v[i] < m) m = l.v[i];
  return m;
}
template <typename T>
inline T simd_shuffle(T x, ushort lane, long line = __builtin_LINE()) {
  auto l = simd_values(x, line);
  return l.v[lane & 31u];
}
template <typename T>
inline T simd_shuffle_down(T x, ushort delta, long line = __builtin_LINE()) {
  uint me = harness::self().t.linear % 32;
  auto l = simd_values(x, line);
  uint s = me + delta;
  return s < 32 ? l.v[s] : x;  // past the last lane: the lane's own value (Metal)
}
template <typename T>
inline T simd_shuffle_up(T x, ushort delta, long line = __builtin_LINE()) {
  uint me = harness::self().t.linear % 32;
  auto l = simd_values(x, line);
  return me >= delta ? l.v[me - delta] : x;
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask, long line = __builtin_LINE()) {
  uint me = harness::self().t.linear % 32;
  auto l = simd_values(x, line);
  return l.v[(me ^ mask) & 31u];
}
template <typename T>
inline T simd_broadcast(T x, ushort lane, long line = __builtin_LINE()) {
  return simd_shuffle(x, lane, line);
}

// Metal Shading Language compatibility layer: runs kernel bodies written for
// mx.fast.metal_kernel on a CPU (driven by tests/metal_harness.py).
//
// Each threadgroup runs as cooperative fibers (ucontext), one per thread, so
// threadgroup_barrier and the SIMD-group operations (simd_sum, simd_shuffle,
// ...) really wait for the other threads: a kernel whose lanes disagree about
// a barrier deadlocks here as it would on a GPU (reported as an error).
// Threadgroups run one after another; `threadgroup` variables are statics,
// shared by the fibers of the running group.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <algorithm>
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

struct Exchange {  // one rendezvous point: a SIMD group or the threadgroup barrier
  std::vector<uint64_t> vals, snap;
  std::vector<bool> live, snap_live;  // snap_live: who took part in the last completed round
  int size = 0, arrived = 0;
  long generation = 0;
  explicit Exchange(int n = 32) : vals(n), snap(n), live(n, false), snap_live(n, false) {}
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  Thread t;
};

struct Group {
  std::vector<Fiber> fibers;
  std::vector<Exchange> simd;  // per SIMD group (32 lanes by linear index)
  Exchange tg{1024};
  ucontext_t sched;
  int current = 0;
  long spins = 0;
  void (*body)(const Thread&) = nullptr;
};

inline Group*& group() {
  static Group* g = nullptr;
  return g;
}
inline Fiber& self() { return group()->fibers[group()->current]; }

inline void yield() {
  Group* g = group();
  swapcontext(&g->fibers[g->current].ctx, &g->sched);
}

inline void complete(Exchange& e) {
  e.snap = e.vals;
  e.snap_live = e.live;
  e.arrived = 0;
  e.generation++;
}

// Deposit this thread's value, wait for every live member, return the snapshot.
inline const std::vector<uint64_t>& rendezvous(Exchange& e, int slot, uint64_t value) {
  e.vals[slot] = value;
  long gen = e.generation;
  if (++e.arrived == e.size) {
    complete(e);
  } else {
    while (e.generation == gen) {
      if (++group()->spins > 200000000L) {
        std::fprintf(stderr, "harness: deadlock at a barrier or SIMD operation\n");
        std::exit(3);
      }
      yield();
    }
  }
  return e.snap;
}

// A finished thread stops counting at its SIMD group and at the barrier.
inline void leave(Exchange& e, int slot) {
  e.live[slot] = false;
  e.size--;
  if (e.size > 0 && e.arrived == e.size) complete(e);
}

inline void trampoline(int idx) {
  Group* g = group();
  Fiber& f = g->fibers[idx];
  g->body(f.t);
  f.done = true;
  leave(g->simd[f.t.linear / 32], f.t.linear % 32);
  leave(g->tg, f.t.linear);
  swapcontext(&f.ctx, &g->sched);
}

inline void run_group(uint3 grid, uint3 tg, uint3 gpos, uint3 groups, void (*body)(const Thread&)) {
  Group g;
  g.body = body;
  const uint per = tg.x * tg.y * tg.z;
  if (per > 1024) {
    std::fprintf(stderr, "harness: threadgroup of %u threads (Metal allows 1024)\n", per);
    std::exit(4);
  }
  g.simd.assign((per + 31) / 32, Exchange(32));
  g.fibers.reserve(per);
  for (uint z = 0; z < tg.z; ++z)
    for (uint y = 0; y < tg.y; ++y)
      for (uint x = 0; x < tg.x; ++x) {
        uint3 pos = {gpos.x * tg.x + x, gpos.y * tg.y + y, gpos.z * tg.z + z};
        if (pos.x >= grid.x || pos.y >= grid.y || pos.z >= grid.z) continue;  // non-uniform edge group
        Fiber f;
        f.t = {pos, {x, y, z}, gpos, tg, groups, x + y * tg.x + z * tg.x * tg.y};
        g.fibers.push_back(std::move(f));
      }
  for (auto& f : g.fibers) {
    auto& e = g.simd[f.t.linear / 32];
    e.live[f.t.linear % 32] = true;
    e.size++;
    g.tg.live[f.t.linear] = true;
    g.tg.size++;
  }
  group() = &g;
  for (size_t i = 0; i < g.fibers.size(); ++i) {
    Fiber& f = g.fibers[i];
    f.stack.resize(1 << 18);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, (void (*)())trampoline, 1, int(i));
  }
  bool all_done = false;
  while (!all_done) {  // round robin until every thread has returned
    all_done = true;
    for (size_t i = 0; i < g.fibers.size(); ++i) {
      if (g.fibers[i].done) continue;
      all_done = false;
      g.current = int(i);
      swapcontext(&g.sched, &g.fibers[i].ctx);
    }
  }
  group() = nullptr;
}

inline void dispatch(uint3 grid, uint3 tg, void (*body)(const Thread&)) {
  uint3 groups = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  for (uint z = 0; z < groups.z; ++z)
    for (uint y = 0; y < groups.y; ++y)
      for (uint x = 0; x < groups.x; ++x) run_group(grid, tg, {x, y, z}, groups, body);
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
inline void threadgroup_barrier(metal::mem_flags = metal::mem_flags::mem_none) {
  harness::rendezvous(harness::group()->tg, harness::self().t.linear, 0);
}
inline void simdgroup_barrier(metal::mem_flags = metal::mem_flags::mem_none) {
  uint l = harness::self().t.linear;
  harness::rendezvous(harness::group()->simd[l / 32], l % 32, 0);
}

// Every lane's value after all live lanes of this SIMD group arrived (lanes
// that do not exist or have returned are not live).
template <typename T>
struct Lanes {
  T v[32];
  bool live[32];
};
template <typename T>
inline Lanes<T> simd_values(T x) {
  uint l = harness::self().t.linear;
  auto& e = harness::group()->simd[l / 32];
  const auto& snap = harness::rendezvous(e, l % 32, harness::pack(x));
  Lanes<T> out;
  for (int i = 0; i < 32; ++i) {
    out.live[i] = e.snap_live[i];
    out.v[i] = harness::unpack<T>(snap[i]);
  }
  return out;
}

template <typename T>
inline T simd_sum(T x) {
  auto l = simd_values(x);
  T v[32];
  for (int i = 0; i < 32; ++i) v[i] = l.live[i] ? l.v[i] : T(0);
  for (int w = 1; w < 32; w *= 2)  // pairwise (tree) order, as SIMD reductions combine lanes
    for (int i = 0; i + w < 32; i += 2 * w) v[i] = T(v[i] + v[i + w]);
  return v[0];
}
template <typename T>
inline T simd_max(T x) {
  auto l = simd_values(x);
  T m = x;
  for (int i = 0; i < 32; ++i)
    if (l.live[i] && l.v[i] > m) m = l.v[i];
  return m;
}
template <typename T>
inline T simd_min(T x) {
  auto l = simd_values(x);
  T m = x;
  for (int i = 0; i < 32; ++i)
    if (l.live[i] && l.v[i] < m) m = l.v[i];
  return m;
}
template <typename T>
inline T simd_shuffle(T x, ushort lane) {
  auto l = simd_values(x);
  return lane < 32 && l.live[lane] ? l.v[lane] : x;
}
template <typename T>
inline T simd_shuffle_down(T x, ushort delta) {
  uint me = harness::self().t.linear % 32;
  auto l = simd_values(x);
  uint s = me + delta;
  return s < 32 && l.live[s] ? l.v[s] : x;
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask) {
  uint me = harness::self().t.linear % 32;
  auto l = simd_values(x);
  uint s = (me ^ mask) & 31u;
  return l.live[s] ? l.v[s] : x;
}
template <typename T>
inline T simd_broadcast(T x, ushort lane) {
  return simd_shuffle(x, lane);
}

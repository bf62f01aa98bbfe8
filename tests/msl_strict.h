// A strict stand-in for <metal_stdlib> and MLX's kernel utilities, for
// front-end checking of Metal kernels with clang (tests/msl_check.py).
// Declarations only: the check parses and type-checks, it does not link.
//
// As in MSL: `device`, `constant` and `threadgroup` are distinct address
// spaces, so passing a `constant` pointer where a `device` one is expected
// (or dropping the qualifier) is a hard error; `double` does not exist; no
// standard library is reachable (`std::` is undeclared, -nostdinc); the
// command line adds C++14 without extensions (VLAs, `if constexpr`, GNU
// statement expressions fail), no exceptions and no RTTI. Recursion is
// rejected by msl_check.py from the AST.
#pragma once
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
// A `threadgroup` array at kernel scope is one per threadgroup: a static in
// its own address space (clang rejects an address space on an automatic).
#define threadgroup static __attribute__((address_space(3)))
#define thread
#define kernel
#define METAL_FUNC inline
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wkeyword-macro"
#define double __double_is_not_a_metal_type
#pragma clang diagnostic pop

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef _Float16 half;
typedef half float16_t;  // MLX's name for float16 in generated signatures
typedef __bf16 bfloat;
typedef __bf16 bfloat16_t;

template <typename T>
struct vec2_ { T x, y; };
template <typename T>
struct vec3_ { T x, y, z; };
template <typename T>
struct vec4_ { T x, y, z, w; };
typedef vec2_<uint> uint2;
typedef vec3_<uint> uint3;
typedef vec2_<float> float2;
typedef vec3_<float> float3;
typedef vec4_<float> float4;
typedef vec4_<half> half4;

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

#define MSL_UNARY(name) float name(float); half name(half);
MSL_UNARY(abs) MSL_UNARY(ceil) MSL_UNARY(cos) MSL_UNARY(exp) MSL_UNARY(exp2) MSL_UNARY(floor)
MSL_UNARY(log) MSL_UNARY(log2) MSL_UNARY(rsqrt) MSL_UNARY(sin) MSL_UNARY(sqrt) MSL_UNARY(tanh)
MSL_UNARY(fabs) MSL_UNARY(round) MSL_UNARY(trunc)
#undef MSL_UNARY
float fma(float, float, float);
half fma(half, half, half);
float pow(float, float);
int abs(int);
template <typename T> T max(T, T);
template <typename T> T min(T, T);
template <typename T> T clamp(T, T, T);
template <typename T> T select(T, T, bool);
namespace fast {
float exp(float); float log(float); float sqrt(float); float rsqrt(float); float tanh(float);
}
namespace precise {
float exp(float); float log(float); float sqrt(float); float rsqrt(float); float tanh(float);
}

void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename T> T simd_sum(T);
template <typename T> T simd_prefix_inclusive_sum(T);
template <typename T> T simd_prefix_exclusive_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_shuffle_up(T, ushort);
template <typename T> T simd_broadcast(T, ushort);
bool simd_all(bool);
bool simd_any(bool);
}  // namespace metal
using namespace metal;

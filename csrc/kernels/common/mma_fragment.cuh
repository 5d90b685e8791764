// The m16n8 accumulator fragment's coordinates: which row and column of its 16 x 8 tile each register of a lane
// holds. mma.sync m16n8kK (the generic family) and each warp's 16 rows of a wgmma accumulator (the Hopper family)
// share this layout: lane = 4·g + t4 holds rows g and g + 8, columns 2·t4 and 2·t4 + 1, as four registers e (bit 0
// the column's parity, bit 1 the row half). A thread's grid of such tiles (mt down, nt across) puts element e of
// tile (mt, nt) at row r0 + mt·16 + g + 8·(e >> 1), column c0 + nt·8 + 2·t4 + (e & 1), r0 / c0 the grid's first row
// and column. A transposed use (the backward's Sᵀ: rows are keys) reads row() as the key and col() as the query.
// The sums keep the order the kernels wrote them in before (base first), so the generated code is the same.
#pragma once

#include <cuda_runtime.h>

namespace mhakit {

#if defined(__CUDACC__)

struct MmaFragLane {
    int g;   // lane / 4: the rows g, g + 8 of each tile
    int t4;  // lane % 4: the columns 2·t4, 2·t4 + 1 of each tile

    // This thread's lane.
    __device__ __forceinline__ static MmaFragLane of_thread() {
        const int lane = static_cast<int>(threadIdx.x & 31);
        return {lane >> 2, lane & 3};
    }
    // Row of element e of the tiles in row mt of a grid starting at row r0.
    __device__ __forceinline__ int row(int r0, int mt, int e) const { return r0 + mt * 16 + g + 8 * (e >> 1); }
    // The first of the thread's two columns (elements e = 0, 1 and 2, 3) of the tiles in column nt, from column c0.
    __device__ __forceinline__ int col_pair(int c0, int nt) const { return c0 + nt * 8 + 2 * t4; }
    // Column of element e of the tiles in column nt of a grid starting at column c0.
    __device__ __forceinline__ int col(int c0, int nt, int e) const { return col_pair(c0, nt) + (e & 1); }
};

#endif  // __CUDACC__

}  // namespace mhakit

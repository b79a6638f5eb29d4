// `heatmap`: attention weights of one batch row as a PNG, one heat map per head in
// a grid, rows = query positions, columns = key positions, on a viridis colour scale
// with a colour bar. Masked entries are left blank (the white background), so
// padding is visible at a glance. The scale (HeatmapScale) is linear from 0 to the
// largest weight by default; log and per-row scales keep a causal map readable,
// where row 0's single weight of 1 would darken every other row.
//
//   HeatmapLayout layout = RenderHeatmap("attention.png", weights, 5, 4, 6, masked,
//                                        {.title = "model default, batch row 0"}).value();
//   layout.heads[2].x, .y: the top-left pixel of head 2's map; each cell is
//   cell_size x cell_size pixels, cell (q, k) at (x + k * cell_size, y + q * cell_size).
#ifndef MHA_CLIENT_HEATMAP_HEATMAP_H_
#define MHA_CLIENT_HEATMAP_HEATMAP_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace mha::client {

enum class HeatmapScale {
  kLinear,  // w / max_weight: one scale shared by every map
  kLog,     // log10(w) from min_weight (0) to max_weight (1); smaller weights at 0
  kRow,     // w / (the largest unmasked weight of its query row in its map)
};

struct HeatmapStyle {
  std::string title;
  HeatmapScale scale = HeatmapScale::kLinear;
  int cell_size = 0;  // pixels per weight; 0 = fit each map in about 240 pixels
  int columns = 0;    // maps per grid row; 0 = ceil(sqrt(heads))
};

struct HeatmapLayout {
  struct Map {
    int head = 0;
    int x = 0, y = 0;  // top-left pixel of cell (0, 0)
  };
  int width = 0, height = 0;
  int cell_size = 0;
  int64_t rows = 0, cols = 0;  // Q, K
  std::vector<Map> heads;
  int bar_x = 0, bar_y = 0, bar_width = 0, bar_height = 0;  // colour bar
  float max_weight = 0;  // the largest unmasked finite weight: the top of kLinear and kLog
  // kLog: the bottom of the scale, the smallest unmasked positive weight but at least
  // max_weight * 1e-6; 0 for the other scales.
  float min_weight = 0;
};

// `weights` is (heads, Q, K) row-major; masked(q, k) entries are drawn blank.
// INVALID_ARGUMENT if the image would exceed 16384 pixels a side or cannot be written.
absl::StatusOr<HeatmapLayout> RenderHeatmap(const std::string& path,
                                            absl::Span<const float> weights, int64_t heads,
                                            int64_t rows, int64_t cols,
                                            const std::function<bool(int64_t, int64_t)>& masked,
                                            const HeatmapStyle& style);

// The colour bar's and the map's position of `weight` in [0, 1] for `layout`'s
// scale; `row_max` is the largest weight of its row (kRow only).
double ScalePosition(HeatmapScale scale, const HeatmapLayout& layout, float weight, float row_max);

// "linear", "log", "row".
const char* HeatmapScaleName(HeatmapScale scale);

// The colour of `t` in [0, 1] on the viridis scale, as 8-bit RGB.
void Viridis(double t, uint8_t rgb[3]);

}  // namespace mha::client

#endif  // MHA_CLIENT_HEATMAP_HEATMAP_H_

#include "client/heatmap/heatmap.h"

#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace mha::client {
namespace {

// matplotlib's viridis at 9 evenly spaced points; linear in between.
constexpr uint8_t kViridis[9][3] = {{68, 1, 84},    {71, 45, 123},  {59, 82, 139},
                                    {44, 114, 142}, {33, 145, 140}, {40, 174, 128},
                                    {94, 201, 98},  {173, 220, 48}, {253, 231, 37}};

// Pixels; chosen so tick labels and titles at 11-13 pt fit.
constexpr int kMargin = 16;
constexpr int kTitleHeight = 30;
constexpr int kPanelTitle = 20;  // "head i" above each map
constexpr int kLeftAxis = 46;    // query tick labels and the rotated axis label
constexpr int kBottomAxis = 36;  // key tick labels and the axis label
constexpr int kGap = 18;
constexpr int kBarWidth = 18;
constexpr int kBarLabels = 56;

struct CairoDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};

void SetColor(cairo_t* cr, const uint8_t rgb[3]) {
  cairo_set_source_rgb(cr, rgb[0] / 255.0, rgb[1] / 255.0, rgb[2] / 255.0);
}

void Text(cairo_t* cr, const std::string& text, double x, double y, double align_x, double size) {
  cairo_set_font_size(cr, size);
  cairo_text_extents_t extents;
  cairo_text_extents(cr, text.c_str(), &extents);
  cairo_move_to(cr, x - align_x * extents.width - extents.x_bearing, y);
  cairo_show_text(cr, text.c_str());
}

// Ticks at every position when cells are wide enough for a label, else every n-th.
int64_t TickStep(int cell_size) {
  for (int64_t step : {1, 2, 5, 10, 20, 50, 100, 200, 500}) {
    if (step * cell_size >= 16) return step;
  }
  return 1000;
}

void DrawTitle(cairo_t* cr, const std::string& title) {
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_source_rgb(cr, 0, 0, 0);
  Text(cr, title, kMargin, kMargin + 16, 0, 14);
}

// Where everything goes: a grid of maps, each with its title and axes, and the
// colour bar beside it. INVALID_ARGUMENT past 16384 pixels a side.
absl::StatusOr<HeatmapLayout> PlanLayout(int64_t heads, int64_t rows, int64_t cols,
                                         const HeatmapStyle& style) {
  HeatmapLayout layout;
  layout.rows = rows;
  layout.cols = cols;
  layout.cell_size = style.cell_size > 0
                         ? style.cell_size
                         : static_cast<int>(std::clamp<int64_t>(240 / std::max(rows, cols), 1, 40));
  const int columns = style.columns > 0
                          ? style.columns
                          : static_cast<int>(std::ceil(std::sqrt(static_cast<double>(heads))));
  const int64_t grid_rows = (heads + columns - 1) / columns;
  const int64_t map_w = cols * layout.cell_size, map_h = rows * layout.cell_size;
  const int64_t panel_w = kLeftAxis + map_w + kGap, panel_h = kPanelTitle + map_h + kBottomAxis;
  const int64_t width =
      kMargin + std::min<int64_t>(columns, heads) * panel_w + kBarWidth + kBarLabels + kMargin;
  const int64_t height = kMargin + kTitleHeight + grid_rows * panel_h + kMargin;
  if (width > 16384 || height > 16384) {
    return absl::InvalidArgumentError(
        absl::StrCat("heatmap: the image would be ", width, " x ", height,
                     " pixels; use a smaller --cell_size, fewer positions or more --columns"));
  }
  layout.width = static_cast<int>(width);
  layout.height = static_cast<int>(height);
  for (int64_t head = 0; head < heads; ++head) {
    const int64_t px = kMargin + (head % columns) * panel_w;
    const int64_t py = kMargin + kTitleHeight + (head / columns) * panel_h;
    layout.heads.push_back({.head = static_cast<int>(head),
                            .x = static_cast<int>(px + kLeftAxis),
                            .y = static_cast<int>(py + kPanelTitle)});
  }
  // Colour bar beside the grid: 0 at the bottom, max_weight at the top.
  layout.bar_x = static_cast<int>(width - kMargin - kBarLabels - kBarWidth);
  layout.bar_y = kMargin + kTitleHeight + kPanelTitle;
  layout.bar_width = kBarWidth;
  layout.bar_height = static_cast<int>(std::max<int64_t>(map_h, 60));
  return layout;
}

// The largest finite weight that is not masked, and the smallest positive one.
void WeightRange(absl::Span<const float> weights, int64_t rows, int64_t cols,
                 const std::function<bool(int64_t, int64_t)>& masked, float* max_weight,
                 float* min_positive) {
  *max_weight = 0;
  *min_positive = INFINITY;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t k = static_cast<int64_t>(i) % cols, q = (static_cast<int64_t>(i) / cols) % rows;
    if (masked(q, k) || !std::isfinite(weights[i])) continue;
    *max_weight = std::max(*max_weight, weights[i]);
    if (weights[i] > 0) *min_positive = std::min(*min_positive, weights[i]);
  }
}

// One head's (rows, cols) weights as cells on `layout`'s scale, and a frame around them.
void DrawCells(cairo_t* cr, const HeatmapLayout& layout, HeatmapScale scale,
               const HeatmapLayout::Map& map, absl::Span<const float> weights,
               const std::function<bool(int64_t, int64_t)>& masked) {
  const double c = layout.cell_size;
  // Cells: whole pixels and no antialiasing, so a masked cell stays exactly background.
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
  for (int64_t q = 0; q < layout.rows; ++q) {
    float row_max = 0;
    for (int64_t k = 0; k < layout.cols; ++k) {
      const float w = weights[static_cast<size_t>(q * layout.cols + k)];
      if (!masked(q, k) && std::isfinite(w)) row_max = std::max(row_max, w);
    }
    for (int64_t k = 0; k < layout.cols; ++k) {
      if (masked(q, k)) continue;
      uint8_t rgb[3];
      Viridis(
          ScalePosition(scale, layout, weights[static_cast<size_t>(q * layout.cols + k)], row_max),
          rgb);
      SetColor(cr, rgb);
      cairo_rectangle(cr, map.x + k * c, map.y + q * c, c, c);
      cairo_fill(cr);
    }
  }
  cairo_set_source_rgb(cr, 0.55, 0.55, 0.55);
  cairo_set_line_width(cr, 1);
  cairo_rectangle(cr, map.x - 0.5, map.y - 0.5, layout.cols * layout.cell_size + 1,
                  layout.rows * layout.cell_size + 1);
  cairo_stroke(cr);
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_DEFAULT);
}

// The map's title, ticks and axis labels.
void DrawAxes(cairo_t* cr, const HeatmapLayout& layout, const HeatmapLayout::Map& map) {
  const double c = layout.cell_size;
  const int64_t map_w = layout.cols * layout.cell_size, map_h = layout.rows * layout.cell_size;
  const int64_t tick_step = TickStep(layout.cell_size);
  cairo_set_source_rgb(cr, 0, 0, 0);
  Text(cr, absl::StrCat("head ", map.head), map.x + map_w / 2.0, map.y - kPanelTitle + 14, 0.5, 12);
  for (int64_t k = 0; k < layout.cols; k += tick_step) {
    Text(cr, absl::StrCat(k), map.x + (k + 0.5) * c, map.y + map_h + 13, 0.5, 10);
  }
  for (int64_t q = 0; q < layout.rows; q += tick_step) {
    Text(cr, absl::StrCat(q), map.x - 4, map.y + (q + 0.5) * c + 4, 1.0, 10);
  }
  Text(cr, "key position", map.x + map_w / 2.0, map.y + map_h + 29, 0.5, 11);
  cairo_save(cr);
  cairo_translate(cr, map.x - kLeftAxis + 12, map.y + map_h / 2.0);
  cairo_rotate(cr, -M_PI / 2);
  Text(cr, "query position", 0, 0, 0.5, 11);
  cairo_restore(cr);
}

// The weight at position t of the colour bar, as its label.
std::string BarLabel(HeatmapScale scale, const HeatmapLayout& layout, double t) {
  switch (scale) {
    case HeatmapScale::kLog:
      return absl::StrFormat(
          "%.3g", layout.min_weight * std::pow(layout.max_weight / layout.min_weight, t));
    case HeatmapScale::kRow:
      return t == 0 ? "0" : absl::StrFormat("%.3g x max", t);
    default:
      return absl::StrFormat("%.3g", t * layout.max_weight);
  }
}

void DrawColourBar(cairo_t* cr, const HeatmapLayout& layout, HeatmapScale scale) {
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
  for (int y = 0; y < layout.bar_height; ++y) {
    uint8_t rgb[3];
    Viridis(1.0 - (y + 0.5) / layout.bar_height, rgb);
    SetColor(cr, rgb);
    cairo_rectangle(cr, layout.bar_x, layout.bar_y + y, layout.bar_width, 1);
    cairo_fill(cr);
  }
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_DEFAULT);
  cairo_set_source_rgb(cr, 0, 0, 0);
  for (double t : {0.0, 0.5, 1.0}) {
    const double y = layout.bar_y + (1.0 - t) * layout.bar_height;
    cairo_move_to(cr, layout.bar_x + kBarWidth, y);
    cairo_line_to(cr, layout.bar_x + kBarWidth + 4, y);
    cairo_stroke(cr);
    Text(cr, BarLabel(scale, layout, t), layout.bar_x + kBarWidth + 7, y + 4, 0, 10);
  }
  Text(cr,
       scale == HeatmapScale::kLog   ? "weight (log)"
       : scale == HeatmapScale::kRow ? "weight / row max"
                                     : "weight",
       layout.bar_x, layout.bar_y - 6, 0, 10);
}

}  // namespace

double ScalePosition(HeatmapScale scale, const HeatmapLayout& layout, float weight, float row_max) {
  switch (scale) {
    case HeatmapScale::kLog:
      if (!(weight > layout.min_weight) || layout.max_weight <= layout.min_weight) {
        return weight >= layout.max_weight && layout.max_weight > 0 ? 1.0 : 0.0;
      }
      return std::log(weight / layout.min_weight) / std::log(layout.max_weight / layout.min_weight);
    case HeatmapScale::kRow:
      return row_max > 0 ? weight / row_max : 0.0;
    default:
      return layout.max_weight > 0 ? weight / layout.max_weight : weight;
  }
}

const char* HeatmapScaleName(HeatmapScale scale) {
  switch (scale) {
    case HeatmapScale::kLog:
      return "log";
    case HeatmapScale::kRow:
      return "row";
    default:
      return "linear";
  }
}

void Viridis(double t, uint8_t rgb[3]) {
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * 8;
  const int i = std::min(static_cast<int>(t), 7);
  const double f = t - i;
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<uint8_t>(
        std::lround(kViridis[i][c] + f * (kViridis[i + 1][c] - kViridis[i][c])));
  }
}

absl::StatusOr<HeatmapLayout> RenderHeatmap(const std::string& path,
                                            absl::Span<const float> weights, int64_t heads,
                                            int64_t rows, int64_t cols,
                                            const std::function<bool(int64_t, int64_t)>& masked,
                                            const HeatmapStyle& style) {
  if (heads < 1 || rows < 1 || cols < 1 ||
      weights.size() != static_cast<size_t>(heads * rows * cols)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heatmap: ", weights.size(), " weights for shape (", heads, ", ", rows, ", ", cols, ")"));
  }
  MHA_ASSIGN_OR_RETURN(HeatmapLayout layout, PlanLayout(heads, rows, cols, style));
  float min_positive = 0;
  WeightRange(weights, rows, cols, masked, &layout.max_weight, &min_positive);
  if (style.scale == HeatmapScale::kLog) {
    layout.min_weight = std::isfinite(min_positive)
                            ? std::max(min_positive, layout.max_weight * 1e-6f)
                            : layout.max_weight;
  }

  std::unique_ptr<cairo_surface_t, CairoDeleter> surface(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, layout.width, layout.height));
  std::unique_ptr<cairo_t, CairoDeleter> context(cairo_create(surface.get()));
  cairo_t* cr = context.get();
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  DrawTitle(cr, style.title);
  const size_t map_size = static_cast<size_t>(rows * cols);
  for (const HeatmapLayout::Map& map : layout.heads) {
    DrawCells(cr, layout, style.scale, map,
              weights.subspan(static_cast<size_t>(map.head) * map_size, map_size), masked);
    DrawAxes(cr, layout, map);
  }
  DrawColourBar(cr, layout, style.scale);

  cairo_surface_flush(surface.get());
  if (cairo_surface_write_to_png(surface.get(), path.c_str()) != CAIRO_STATUS_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot write the PNG"));
  }
  return layout;
}

}  // namespace mha::client

#include "client/heatmap/heatmap.h"

#include <cairo.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "gtest/gtest.h"

namespace mha::client {
namespace {

TEST(HeatmapTest, ViridisEnds) {
  uint8_t rgb[3];
  Viridis(0, rgb);
  EXPECT_EQ(rgb[0], 68);
  EXPECT_EQ(rgb[1], 1);
  EXPECT_EQ(rgb[2], 84);
  Viridis(1, rgb);
  EXPECT_EQ(rgb[0], 253);
  EXPECT_EQ(rgb[1], 231);
  EXPECT_EQ(rgb[2], 37);
  Viridis(2, rgb);  // clamped
  EXPECT_EQ(rgb[0], 253);
}

uint32_t Pixel(cairo_surface_t* surface, int x, int y) {
  uint32_t p;
  std::memcpy(
      &p,
      cairo_image_surface_get_data(surface) + y * cairo_image_surface_get_stride(surface) + x * 4,
      4);
  return p & 0xffffff;
}

TEST(HeatmapTest, CellsAreWhereTheLayoutSaysAndMaskedOnesBlank) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("mha_heatmap_test_" + std::to_string(getpid()) + ".png"))
                               .string();
  // 2 heads of 2 x 3; head 1 has a zero weight that must still be coloured.
  const std::vector<float> weights = {0.5f, 0.5f, 0, 1, 0, 0, 0.25f, 0.75f, 0, 0.0f, 1, 0};
  auto layout = RenderHeatmap(path, weights, 2, 2, 3, [](int64_t, int64_t k) { return k == 2; },
                              {.title = "t"});
  ASSERT_TRUE(layout.ok()) << layout.status();
  cairo_surface_t* png = cairo_image_surface_create_from_png(path.c_str());
  ASSERT_EQ(cairo_surface_status(png), CAIRO_STATUS_SUCCESS);
  EXPECT_EQ(cairo_image_surface_get_width(png), layout->width);
  EXPECT_EQ(cairo_image_surface_get_height(png), layout->height);
  EXPECT_EQ(layout->heads.size(), 2u);
  EXPECT_FLOAT_EQ(layout->max_weight, 1.0f);
  const int c = layout->cell_size;
  auto cell = [&](int head, int q, int k) {
    return Pixel(png, layout->heads[head].x + k * c + c / 2, layout->heads[head].y + q * c + c / 2);
  };
  EXPECT_EQ(cell(0, 0, 2), 0xffffffu);
  EXPECT_EQ(cell(1, 1, 2), 0xffffffu);
  EXPECT_EQ(cell(0, 1, 0), 0xfde725u);  // weight 1: viridis' yellow
  EXPECT_EQ(cell(1, 1, 0), 0x440154u);  // weight 0, unmasked: viridis' purple
  EXPECT_NE(cell(0, 0, 0), 0xffffffu);
  cairo_surface_destroy(png);
  std::remove(path.c_str());

  EXPECT_FALSE(
      RenderHeatmap(path, weights, 2, 2, 2, [](int64_t, int64_t) { return false; }, {}).ok())
      << "size mismatch";
  EXPECT_FALSE(RenderHeatmap("/nonexistent/dir/x.png", weights, 2, 2, 3,
                             [](int64_t, int64_t) { return false; }, {})
                   .ok());
}

}  // namespace
}  // namespace mha::client

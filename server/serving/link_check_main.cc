// The program of the serving layer's link check (CMakeLists.txt): its only job is to
// be linked with every object of libmha_serving.a and the libraries the layer may use.
int main() { return 0; }

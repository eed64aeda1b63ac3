# find_package(coconet CONFIG) from a source checkout: pass -Dcoconet_DIR=<checkout>/cmake (or add
# <checkout>/cmake to CMAKE_PREFIX_PATH). Everything is in coconet.cmake.
include("${CMAKE_CURRENT_LIST_DIR}/coconet.cmake")
set(coconet_FOUND TRUE)

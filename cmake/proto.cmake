# protobuf-c code for every proto/*.proto, generated into the build tree at
# build time (never committed, never edited) and compiled into td_proto.
# Sources include it as "proto/<name>.pb-c.h".
find_program(TD_PROTOC_C NAMES protoc-c protoc-gen-c REQUIRED)

file(GLOB TD_PROTO_FILES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/proto/*.proto)
set(TD_PROTO_GEN_DIR ${CMAKE_BINARY_DIR}/proto-gen)
file(MAKE_DIRECTORY ${TD_PROTO_GEN_DIR}/proto)

set(TD_PROTO_SOURCES "")
set(TD_PROTO_HEADERS "")
foreach(proto ${TD_PROTO_FILES})
  get_filename_component(name ${proto} NAME_WE)
  set(c ${TD_PROTO_GEN_DIR}/proto/${name}.pb-c.c)
  set(h ${TD_PROTO_GEN_DIR}/proto/${name}.pb-c.h)
  add_custom_command(
    OUTPUT ${c} ${h}
    COMMAND ${TD_PROTOC_C} --proto_path=${CMAKE_SOURCE_DIR} --c_out=${TD_PROTO_GEN_DIR}
            proto/${name}.proto
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}
    DEPENDS ${proto}
    COMMENT "protoc-c proto/${name}.proto"
    VERBATIM)
  list(APPEND TD_PROTO_SOURCES ${c})
  list(APPEND TD_PROTO_HEADERS ${h})
endforeach()

if(TD_PROTO_SOURCES)
  # Generated code is not ours to warn about.
  set_source_files_properties(${TD_PROTO_SOURCES} PROPERTIES COMPILE_OPTIONS "-w")
  add_library(td_proto STATIC ${TD_PROTO_SOURCES} ${TD_PROTO_HEADERS})
  target_include_directories(td_proto PUBLIC ${TD_PROTO_GEN_DIR})
  target_link_libraries(td_proto PUBLIC PkgConfig::PROTOBUF_C)
endif()
